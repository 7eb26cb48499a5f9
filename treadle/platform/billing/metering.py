"""Metering: what an operation may cost when it is admitted, and what it cost when it completed.

Admission (`reserve`, in the transaction that appends the request) holds the operation's most
possible cost (exact for forward_backward; prompt + max_tokens x num_samples for sampling) at
the highest price in effect now or scheduled, against its tenant's monthly budget and its
session's spend cap, and refuses (402) what would exceed either: settled + reserved never passes
a budget, because every admission of a tenant locks its month's row. Completion (`charge`, in
the settlement's transaction) writes the operation's one usage row at the prices in effect then,
and releases its reservation; a failed or stopped operation only releases it (`release`).
Both run in every operation's admission and settlement, so each takes few statements: a month
row is created, locked and updated by one upsert (`_add_month`). Month rows are always locked in
(tenant, month) order. Money is integer micro-dollars. Imports nothing from api, engine,
worker or torch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

import sqlalchemy as sa

from treadle.platform import metrics
from treadle.platform.billing import prices, quotas
from treadle.platform.errors import QuotaExceededError, RequestTooLargeError
from treadle.platform.eventlog.optypes import ForwardBackward, Payload, Sample
from treadle.platform.eventlog.schema import reservations, sessions, tenant_months, usage
from treadle.platform.sessions.sessions import SessionRow

CLASSES = prices.TOKEN_CLASSES
# This calendar month (UTC) as its first day, by the database's clock (its transaction's start).
THIS_MONTH = sa.cast(sa.func.date_trunc("month", sa.func.timezone("UTC", sa.func.now())), sa.Date)


@dataclass(frozen=True)
class Tokens:
    prefill: int = 0
    sample: int = 0
    train: int = 0

    @property
    def total(self) -> int:
        return self.prefill + self.sample + self.train

    def by_class(self) -> dict[str, int]:
        return {"prefill": self.prefill, "sample": self.sample, "train": self.train}


@dataclass(frozen=True)
class Charge:
    """What one completed operation was billed: tokens and micro-dollars by class."""

    tenant_id: str
    base_model: str
    tokens: Mapping[str, int]
    micro_usd: Mapping[str, int]

    @property
    def total_micro_usd(self) -> int:
        return sum(self.micro_usd.values())


def estimate(payload: Payload) -> Tokens:
    """The most tokens an operation can process, by class."""
    if isinstance(payload, ForwardBackward):
        count = sum(len(d.tokens) for d in payload.data)
        return Tokens(prefill=count) if payload.forward_only else Tokens(train=count)
    if isinstance(payload, Sample):
        return Tokens(
            prefill=len(payload.prompt),
            sample=payload.params.max_tokens * payload.num_samples,
        )
    return Tokens()


def _next_month(month: date) -> str:
    year, m = (month.year + 1, 1) if month.month == 12 else (month.year, month.month + 1)
    return f"{year:04d}-{m:02d}-01T00:00:00Z"


# Statements are built once (`functools.cache`, or here): metering runs in every admission and
# settlement, where building a statement took more CPU than PostgreSQL takes to run it.
# Parameters are named p_*: a bind parameter may not take the name of a column it writes.


@functools.cache
def _month_upsert(names: tuple[str, ...], this_month: bool) -> Any:
    """INSERT ... ON CONFLICT DO UPDATE adding p_<name> to each column of `names` in a tenant's
    month row (p_month, or this month), returning the row as updated."""
    insert = sa.dialects.postgresql.insert(tenant_months).values(
        {
            "tenant_id": sa.bindparam("p_tenant_id"),
            "month": THIS_MONTH if this_month else sa.bindparam("p_month"),
            **{name: sa.bindparam(f"p_{name}") for name in names},
        }
    )
    return insert.on_conflict_do_update(
        index_elements=[tenant_months.c.tenant_id, tenant_months.c.month],
        set_={name: tenant_months.c[name] + insert.excluded[name] for name in names},
    ).returning(tenant_months)


def _add_month(
    conn: sa.Connection, tenant_id: str, month: date | None, **deltas: int
) -> sa.Row[Any]:
    """Add `deltas` to a tenant's month row (None: this month), creating it if missing, in one
    statement that keeps the row locked until the transaction ends (as SELECT ... FOR UPDATE
    would); returns the row as updated."""
    params: dict[str, Any] = {"p_tenant_id": tenant_id, "p_month": month}
    params.update({f"p_{name}": delta for name, delta in deltas.items()})
    return conn.execute(_month_upsert(tuple(deltas), month is None), params).one()


@functools.cache
def _session_update(names: tuple[str, ...]) -> Any:
    return (
        sa.update(sessions)
        .where(sessions.c.id == sa.bindparam("p_session_id"))
        .values({name: sessions.c[name] + sa.bindparam(f"p_{name}") for name in names})
    )


# A reservation: this month's row locked and added to (created if missing; the row as updated is
# returned, for the budget checks), the reservation written under that month and added to its
# session's, in one statement. A refusal after it raises, and the caller's transaction ends
# without commit.
_MONTH_RESERVED = _month_upsert(("reserved_micro_usd", "reserved_tokens"), True).cte("month")
_RESERVED = (
    sa.select(_MONTH_RESERVED)
    .add_cte(
        reservations.insert()
        .from_select(
            ["request_id", "tenant_id", "session_id", "month", "micro_usd", "tokens"],
            sa.select(
                sa.bindparam("p_request_id", type_=sa.Text),
                sa.bindparam("p_tenant_id", type_=sa.Text),
                sa.bindparam("p_session_id", type_=sa.Text),
                _MONTH_RESERVED.c.month,
                sa.bindparam("p_reserved_micro_usd", type_=sa.BigInteger),
                sa.bindparam("p_reserved_tokens", type_=sa.BigInteger),
            ).select_from(_MONTH_RESERVED),
        )
        .cte("held")
    )
    .add_cte(_session_update(("reserved_micro_usd",)).cte("session_held"))
)
# A completed operation's usage row written and its reservation (if any) deleted, in one
# statement that also answers this month and what the reservation held.
USAGE_COLUMNS = (
    "request_id", "tenant_id", "session_id", "sampler_id", "actor", "base_model", "op_type",
    "cost_micro_usd", "unpriced",
    *(f"{c}_{what}" for c in CLASSES for what in ("tokens", "price", "micro_usd")),
)  # fmt: skip
_RELEASED = (
    sa.delete(reservations)
    .where(reservations.c.request_id == sa.bindparam("p_request_id"))
    .returning(reservations.c.month, reservations.c.micro_usd, reservations.c.tokens)
    .cte("released")
)
_CLOCK = sa.select(THIS_MONTH.label("this_month")).subquery("clock")
_CHARGE = (
    sa.select(_CLOCK.c.this_month, _RELEASED.c.month, _RELEASED.c.micro_usd, _RELEASED.c.tokens)
    .select_from(_CLOCK.outerjoin(_RELEASED, sa.true()))
    .add_cte(usage.insert().values({c: sa.bindparam(f"p_{c}") for c in USAGE_COLUMNS}).cte("used"))
)
# A charge's month row (settled added, its reservation freed) and its session's money, in one
# statement; p_reserved_micro_usd is the same for both (what the reservation held, negated).
_CHARGED = _session_update(("spent_micro_usd", "reserved_micro_usd")).add_cte(
    _month_upsert(
        ("settled_micro_usd", "settled_tokens", "reserved_micro_usd", "reserved_tokens"), False
    ).cte("month")
)


def reserve(
    conn: sa.Connection,
    session: SessionRow,
    request_id: str,
    payload: Payload,
    *,
    quota: quotas.Quota,
    price: Mapping[str, int],
) -> None:
    """Hold the operation's most possible cost, or refuse it (402 over a budget or the session's
    cap, 413 over the largest-request quota). The caller holds the session row's lock and read,
    in this transaction, the tenant's `quota` and the base model's highest `price` from now on
    (`prices.highest_from_now`).

    The cost is added to the month's reservations before the budgets are checked (one statement
    locks the row and adds it): a refusal leaves that write in the caller's transaction, which
    the error ends without commit, as it does the request's event.
    """
    tokens = estimate(payload)
    if quota.max_request_tokens is not None and tokens.total > quota.max_request_tokens:
        raise RequestTooLargeError(
            f"this request may process {tokens.total} tokens; tenant {session.tenant_id}'s "
            f"largest request is {quota.max_request_tokens}: send fewer datums, samples or "
            "max_tokens per request",
            limit="max_request_tokens",
            value=quota.max_request_tokens,
            current=tokens.total,
        )
    if tokens.total == 0:
        return
    micro = sum(prices.cost_micro_usd(n, price[c]) for c, n in tokens.by_class().items())
    spent = conn.execute(
        _RESERVED,
        {
            "p_request_id": request_id,
            "p_tenant_id": session.tenant_id,
            "p_session_id": session.id,
            "p_reserved_micro_usd": micro,
            "p_reserved_tokens": tokens.total,
        },
    ).one()
    month = spent.month
    budget = quota.monthly_micro_usd
    in_use = spent.settled_micro_usd + spent.reserved_micro_usd - micro
    if budget is not None and in_use + micro > budget:
        raise QuotaExceededError(
            f"this request may cost ${micro / prices.MICRO:.6f}; tenant {session.tenant_id} has "
            f"${in_use / prices.MICRO:.6f} of its ${budget / prices.MICRO:.2f} monthly budget "
            "spent or held by running operations; wait for the next month or ask the operator "
            "to raise it (`treadle quotas set`)",
            limit="monthly_usd",
            value=budget / prices.MICRO,
            current=in_use / prices.MICRO,
            resets_at=_next_month(month),
        )
    token_budget = quota.monthly_tokens
    tokens_in_use = spent.settled_tokens + spent.reserved_tokens - tokens.total
    if token_budget is not None and tokens_in_use + tokens.total > token_budget:
        raise QuotaExceededError(
            f"this request may process {tokens.total} tokens; tenant {session.tenant_id} has "
            f"{tokens_in_use} of its {token_budget} monthly tokens processed or held; wait for "
            "the next month or ask the operator to raise it",
            limit="monthly_tokens",
            value=token_budget,
            current=tokens_in_use,
            resets_at=_next_month(month),
        )
    cap = session.max_cost_micro_usd
    held = session.spent_micro_usd + session.reserved_micro_usd
    if cap is not None and held + micro > cap:
        raise QuotaExceededError(
            f"this request may cost ${micro / prices.MICRO:.6f}; model {session.id} has "
            f"${held / prices.MICRO:.6f} of its ${cap / prices.MICRO:.6f} cap (max_cost_usd) "
            "spent or held; start a new session (from a checkpoint) to spend more",
            limit="max_cost_usd",
            value=cap / prices.MICRO,
            current=held / prices.MICRO,
        )


def charge(
    conn: sa.Connection,
    *,
    request_id: str,
    session: SessionRow,
    sampler_id: str | None,
    actor: str | None,
    op_type: str,
    tokens: Mapping[str, int],
    price: Mapping[str, int | None] | None = None,
) -> Charge:
    """Write the completed operation's usage row at the prices in effect now (`price`, if the
    caller read them in this transaction already), and release its reservation. The
    settlement's transaction guarantees it runs once per operation; the row's key (the request
    id) guarantees it besides."""
    if price is None:
        price = prices.in_effect(conn, session.base_model)
    counts = {c: int(tokens.get(c, 0)) for c in CLASSES}
    micro = {c: prices.cost_micro_usd(counts[c], price[c]) for c in CLASSES}
    unpriced = any(counts[c] > 0 and price[c] is None for c in CLASSES)
    row: dict[str, Any] = {
        "request_id": request_id,
        "tenant_id": session.tenant_id,
        "session_id": session.id,
        "sampler_id": sampler_id,
        "actor": actor,
        "base_model": session.base_model,
        "op_type": op_type,
        "cost_micro_usd": sum(micro.values()),
        "unpriced": unpriced,
    }
    for c in CLASSES:
        row[f"{c}_tokens"], row[f"{c}_price"], row[f"{c}_micro_usd"] = counts[c], price[c], micro[c]
    found = conn.execute(_CHARGE, {f"p_{c}": row[c] for c in USAGE_COLUMNS}).one()
    total = sum(micro.values())
    settled = {"settled_micro_usd": total, "settled_tokens": sum(counts.values())}
    freed = {"reserved_micro_usd": -(found.micro_usd or 0), "reserved_tokens": -(found.tokens or 0)}
    spent = {"spent_micro_usd": total, "reserved_micro_usd": freed["reserved_micro_usd"]}
    if found.month is None or found.month == found.this_month:
        params: dict[str, Any] = {"p_tenant_id": session.tenant_id, "p_month": found.this_month}
        params.update({f"p_{name}": delta for name, delta in (settled | freed).items()})
        params.update({"p_session_id": session.id, "p_spent_micro_usd": total})
        conn.execute(_CHARGED, params)  # the month's row and the session's, in one statement
        return Charge(session.tenant_id, session.base_model, counts, micro)
    # reserved in an earlier month: that row first (the lock order)
    _add_month(conn, session.tenant_id, found.month, **freed)
    _add_month(conn, session.tenant_id, found.this_month, **settled)
    _add_session(conn, session.id, **spent)
    return Charge(session.tenant_id, session.base_model, counts, micro)


def release(conn: sa.Connection, request_ids: Sequence[str]) -> int:
    """Release the reservations of operations that completed, failed or were stopped; returns
    the micro-dollars released."""
    if not request_ids:
        return 0
    rows = conn.execute(
        sa.delete(reservations)
        .where(reservations.c.request_id.in_(list(request_ids)))
        .returning(
            reservations.c.tenant_id,
            reservations.c.session_id,
            reservations.c.month,
            reservations.c.micro_usd,
            reservations.c.tokens,
        )
    ).all()
    months: dict[tuple[str, date], list[int]] = {}
    by_session: dict[str, int] = {}
    for r in rows:
        month = months.setdefault((r.tenant_id, r.month), [0, 0])
        month[0] += r.micro_usd
        month[1] += r.tokens
        by_session[r.session_id] = by_session.get(r.session_id, 0) + r.micro_usd
    for (tenant_id, month_start), (micro, tokens) in sorted(months.items()):  # the lock order
        _add_month(conn, tenant_id, month_start, reserved_micro_usd=-micro, reserved_tokens=-tokens)
    for session_id, micro in sorted(by_session.items()):
        _add_session(conn, session_id, reserved_micro_usd=-micro)
    return sum(r.micro_usd for r in rows)


def count_charge(charge: Charge) -> None:
    """Count what a completed operation was billed, in the token and cost counters."""
    for token_class, count in charge.tokens.items():
        if count:
            labels = (token_class, charge.base_model, charge.tenant_id)
            metrics.TOKENS.labels(*labels).inc(count)
            metrics.COST.labels(*labels).inc(charge.micro_usd.get(token_class, 0) / prices.MICRO)


def _add_session(conn: sa.Connection, session_id: str, **deltas: int) -> None:
    """Add `deltas` to a session's money columns."""
    params: dict[str, Any] = {"p_session_id": session_id}
    params.update({f"p_{name}": delta for name, delta in deltas.items()})
    conn.execute(_session_update(tuple(deltas)), params)
