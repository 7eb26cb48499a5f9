"""The ledger's read side: usage grouped over a time range, one session's usage and spend, and
the monthly bill.

Everything reads the `usage` rows that `metering.charge` wrote (one per completed operation, at
the prices in effect when it completed), so a later price change never alters a past figure.
Money stays integer micro-dollars; `usd` and `usd_short` format it as decimal strings with no
float arithmetic. Months and days are UTC. Members and tenant admins read their own tenant; the
operator any tenant, or every tenant at once (`ALL_TENANTS`). Hourly buckets and checkpoint
storage for the Tinker billing routes are in `usage_hourly`; price versions and a tenant's quota
beside its spend in `billing_status`.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from treadle.platform.billing.prices import MICRO, TOKEN_CLASSES
from treadle.platform.errors import PermissionDeniedError, ValidationError
from treadle.platform.eventlog.schema import usage
from treadle.platform.sessions.sessions import get_session
from treadle.platform.tenancy import tenants
from treadle.platform.tenancy.tenants import Principal

ALL_TENANTS = "*"  # the operator's "every tenant"; never a valid tenant id

_DAY = sa.func.to_char(sa.func.timezone("UTC", usage.c.completed_at), "YYYY-MM-DD")
# group name -> (column in the answer, the expression grouped by)
GROUPS: dict[str, tuple[str, sa.ColumnElement[Any]]] = {
    "tenant": ("tenant_id", usage.c.tenant_id),
    "session": ("session_id", usage.c.session_id),
    "key": ("key_id", usage.c.actor),
    "base_model": ("base_model", usage.c.base_model),
    "day": ("day", _DAY),
    "op_type": ("op_type", usage.c.op_type),
}


def usd(micro: int) -> str:
    """Micro-dollars as a USD decimal string with all six places: 1234 -> "0.001234"."""
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(micro), MICRO)
    return f"{sign}{whole}.{frac:06d}"


def usd_short(micro: int) -> str:
    """Micro-dollars as USD with the places needed, at least two: 100000 -> "0.10" (prices,
    budgets)."""
    text = usd(micro).rstrip("0")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')}"


@dataclass(frozen=True)
class Totals:
    """Operations, tokens by class and cost of some ledger rows; `unpriced`: some of their
    tokens had no price and were billed at 0."""

    operations: int = 0
    prefill_tokens: int = 0
    sample_tokens: int = 0
    train_tokens: int = 0
    cost_micro_usd: int = 0
    unpriced: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prefill_tokens + self.sample_tokens + self.train_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "operations": self.operations,
            "prefill_tokens": self.prefill_tokens,
            "sample_tokens": self.sample_tokens,
            "train_tokens": self.train_tokens,
            "total_tokens": self.total_tokens,
            "cost_usd": usd(self.cost_micro_usd),
            "cost_micro_usd": self.cost_micro_usd,
            "unpriced": self.unpriced,
        }


_TOTALS = (
    sa.func.count().label("operations"),
    *(
        sa.func.coalesce(sa.func.sum(usage.c[f"{c}_tokens"]), 0).label(f"{c}_tokens")
        for c in TOKEN_CLASSES
    ),
    sa.func.coalesce(sa.func.sum(usage.c.cost_micro_usd), 0).label("cost_micro_usd"),
    sa.func.coalesce(sa.func.bool_or(usage.c.unpriced), False).label("unpriced"),
)


def _totals(row: Any) -> Totals:
    return Totals(
        operations=int(row.operations),
        prefill_tokens=int(row.prefill_tokens),
        sample_tokens=int(row.sample_tokens),
        train_tokens=int(row.train_tokens),
        cost_micro_usd=int(row.cost_micro_usd),
        unpriced=bool(row.unpriced),
    )


@dataclass(frozen=True)
class UsageReport:
    tenant_id: str  # or ALL_TENANTS
    since: datetime
    until: datetime
    by: tuple[str, ...]
    groups: list[tuple[dict[str, str | None], Totals]]
    total: Totals


def tenant_scope(
    conn: sa.Connection, principal: Principal, tenant: str | None, *, allow_all: bool = False
) -> str:
    """The tenant a read is about: the caller's own by default; another (or ALL_TENANTS, where
    `allow_all`) only for the operator. An unknown tenant is a 404."""
    if tenant is None or tenant == principal.tenant_id:
        return principal.tenant_id
    if not principal.is_operator:
        raise PermissionDeniedError(
            f"a {principal.role} key reads its own tenant ({principal.tenant_id}) only; leave "
            "tenant out, or ask the operator (TREADLE_ADMIN_KEY) for another tenant's figures"
        )
    if tenant == ALL_TENANTS:
        if not allow_all:
            raise ValidationError("name one tenant here (tenant=<id>); '*' is for usage only")
        return ALL_TENANTS
    tenants.get_tenant(conn, tenant)
    return tenant


def _window(since: datetime, until: datetime) -> tuple[datetime, datetime]:
    if since.tzinfo is None or until.tzinfo is None:
        raise ValidationError("since and until need a time zone (e.g. 2026-11-01T00:00:00Z)")
    if until <= since:
        raise ValidationError(
            f"until ({until.isoformat()}) must be after since ({since.isoformat()})"
        )
    return since, until


def usage_report(
    conn: sa.Connection,
    principal: Principal,
    *,
    tenant: str | None,
    since: datetime,
    until: datetime,
    by: tuple[str, ...] = (),
) -> UsageReport:
    """Usage completed in [since, until), grouped by any of GROUPS (one group when `by` is
    empty), largest cost first, and the total."""
    unknown = [b for b in by if b not in GROUPS]
    if unknown:
        raise ValidationError(
            f"cannot group by {', '.join(unknown)}; use any of {', '.join(GROUPS)}"
        )
    by = tuple(dict.fromkeys(by))
    scope = tenant_scope(conn, principal, tenant, allow_all=True)
    since, until = _window(since, until)
    where = [usage.c.completed_at >= since, usage.c.completed_at < until]
    if scope != ALL_TENANTS:
        where.append(usage.c.tenant_id == scope)
    keys = [GROUPS[b][1].label(GROUPS[b][0]) for b in by]
    query = sa.select(*keys, *_TOTALS).where(*where)
    if keys:
        query = query.group_by(*keys).order_by(sa.desc("cost_micro_usd"), *keys)
    groups = [
        ({GROUPS[b][0]: getattr(row, GROUPS[b][0]) for b in by}, _totals(row))
        for row in conn.execute(query)
        if row.operations  # an empty range still answers one all-zero row without grouping
    ]
    total = _totals(conn.execute(sa.select(*_TOTALS).where(*where)).one())
    return UsageReport(scope, since, until, by, groups, total)


@dataclass(frozen=True)
class SessionUsage:
    """A session's usage so far, by token class, its spend cap, spend and holds."""

    model_id: str
    base_model: str
    status: str
    totals: Totals
    cost_micro_usd_by_class: dict[str, int]
    max_cost_micro_usd: int | None
    spent_micro_usd: int
    reserved_micro_usd: int


def session_usage(conn: sa.Connection, principal: Principal, model_id: str) -> SessionUsage:
    """One session's usage (404 for another tenant's, like a missing one)."""
    session = get_session(conn, principal, model_id)
    where = (usage.c.session_id == session.id, usage.c.tenant_id == principal.tenant_id)
    by_class = [sa.func.coalesce(sa.func.sum(usage.c[f"{c}_micro_usd"]), 0) for c in TOKEN_CLASSES]
    row = conn.execute(sa.select(*_TOTALS, *by_class).where(*where)).one()
    return SessionUsage(
        model_id=session.id,
        base_model=session.base_model,
        status=session.status,
        totals=_totals(row),
        cost_micro_usd_by_class={
            c: int(row[len(_TOTALS) + i]) for i, c in enumerate(TOKEN_CLASSES)
        },
        max_cost_micro_usd=session.max_cost_micro_usd,
        spent_micro_usd=session.spent_micro_usd,
        reserved_micro_usd=session.reserved_micro_usd,
    )


def month_bounds(year: int, month: int) -> tuple[datetime, datetime]:
    """[first instant, first instant of the next month) of a calendar month, in UTC."""
    if not (1 <= month <= 12 and 2000 <= year <= 9998):
        raise ValidationError(f"month {year:04d}-{month:02d} is not a month; write YYYY-MM")
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC)
    return start, end


@dataclass(frozen=True)
class BillLine:
    """Tokens of one base model and class billed at one unit price (None: unpriced, at 0)."""

    base_model: str
    token_class: str
    micro_usd_per_million: int | None
    tokens: int
    amount_micro_usd: int
    first_at: datetime
    last_at: datetime


@dataclass(frozen=True)
class Bill:
    tenant_id: str
    year: int
    month: int
    since: datetime
    until: datetime
    lines: list[BillLine]

    @property
    def total_micro_usd(self) -> int:
        return sum(line.amount_micro_usd for line in self.lines)

    @property
    def unpriced(self) -> bool:
        return any(line.micro_usd_per_million is None for line in self.lines)


def monthly_bill(
    conn: sa.Connection, principal: Principal, *, tenant: str | None, year: int, month: int
) -> Bill:
    """A tenant's invoice for a UTC month: one line per base model x token class x unit price
    (a price change mid-month gives two lines), in order of first use, then the total."""
    scope = tenant_scope(conn, principal, tenant)
    since, until = month_bounds(year, month)
    lines: list[BillLine] = []
    for token_class in TOKEN_CLASSES:
        tokens, price = usage.c[f"{token_class}_tokens"], usage.c[f"{token_class}_price"]
        rows = conn.execute(
            sa.select(
                usage.c.base_model,
                price.label("price"),
                sa.func.sum(tokens).label("tokens"),
                sa.func.sum(usage.c[f"{token_class}_micro_usd"]).label("amount"),
                sa.func.min(usage.c.completed_at).label("first_at"),
                sa.func.max(usage.c.completed_at).label("last_at"),
            )
            .where(
                usage.c.tenant_id == scope,
                usage.c.completed_at >= since,
                usage.c.completed_at < until,
                tokens > 0,
            )
            .group_by(usage.c.base_model, price)
        )
        lines.extend(
            BillLine(
                r.base_model,
                token_class,
                r.price,
                int(r.tokens),
                int(r.amount),
                r.first_at,
                r.last_at,
            )
            for r in rows
        )
    order = {c: i for i, c in enumerate(TOKEN_CLASSES)}
    lines.sort(key=lambda x: (x.base_model, order[x.token_class], x.first_at))
    return Bill(scope, year, month, since, until, lines)
