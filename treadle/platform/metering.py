"""Metering: what an operation may cost when it is admitted, and what it cost when it completed.

Admission (`reserve`, in the transaction that appends the request) holds the operation's most
possible cost (exact for forward_backward; prompt + max_tokens x num_samples for sampling) at
the highest price in effect now or scheduled, against its tenant's monthly budget and its
session's spend cap, and refuses (402) what would exceed either: settled + reserved never passes
a budget, because every admission of a tenant locks its month's row. Completion (`charge`, in
the settlement's transaction) writes the operation's one usage row at the prices in effect then,
and releases its reservation; a failed or stopped operation only releases it (`release`).
Money is integer micro-dollars. Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

import sqlalchemy as sa

from treadle.platform import prices, quotas
from treadle.platform.errors import QuotaExceededError, RequestTooLargeError
from treadle.platform.optypes import ForwardBackward, Payload, Sample
from treadle.platform.schema import reservations, sessions, tenant_months, usage
from treadle.platform.sessions import SessionRow

CLASSES = prices.TOKEN_CLASSES


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


def _month(conn: sa.Connection) -> date:
    """This calendar month (UTC), as its first day."""
    return conn.execute(
        sa.select(
            sa.cast(sa.func.date_trunc("month", sa.func.timezone("UTC", sa.func.now())), sa.Date)
        )  # fmt: skip
    ).scalar_one()


def _next_month(month: date) -> str:
    year, m = (month.year + 1, 1) if month.month == 12 else (month.year, month.month + 1)
    return f"{year:04d}-{m:02d}-01T00:00:00Z"


def _locked_month(conn: sa.Connection, tenant_id: str, month: date) -> sa.Row[Any]:
    stmt = sa.dialects.postgresql.insert(tenant_months).values(tenant_id=tenant_id, month=month)
    conn.execute(stmt.on_conflict_do_nothing())
    return conn.execute(
        sa.select(tenant_months)
        .where(tenant_months.c.tenant_id == tenant_id, tenant_months.c.month == month)
        .with_for_update()
    ).one()


def reserve(conn: sa.Connection, session: SessionRow, request_id: str, payload: Payload) -> None:
    """Hold the operation's most possible cost, or refuse it (402 over a budget or the session's
    cap, 413 over the largest-request quota). The caller holds the session row's lock."""
    tokens = estimate(payload)
    quota = quotas.get_quota(conn, session.tenant_id)
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
    price = prices.highest_from_now(conn, session.base_model)
    micro = sum(prices.cost_micro_usd(n, price[c]) for c, n in tokens.by_class().items())
    month = _month(conn)
    spent = _locked_month(conn, session.tenant_id, month)
    budget = quota.monthly_micro_usd
    in_use = spent.settled_micro_usd + spent.reserved_micro_usd
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
    tokens_in_use = spent.settled_tokens + spent.reserved_tokens
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
    conn.execute(
        reservations.insert().values(
            request_id=request_id,
            tenant_id=session.tenant_id,
            session_id=session.id,
            month=month,
            micro_usd=micro,
            tokens=tokens.total,
        )
    )
    _add(conn, session.tenant_id, month, reserved_micro_usd=micro, reserved_tokens=tokens.total)
    _add_session(conn, session.id, reserved_micro_usd=micro)


def charge(
    conn: sa.Connection,
    *,
    request_id: str,
    session: SessionRow,
    sampler_id: str | None,
    actor: str | None,
    op_type: str,
    tokens: Mapping[str, int],
) -> Charge:
    """Write the completed operation's usage row at the prices in effect now, and release its
    reservation. The settlement's transaction guarantees it runs once per operation; the row's
    key (the request id) guarantees it besides."""
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
    conn.execute(usage.insert().values(**row))
    release(conn, [request_id])
    total = sum(micro.values())
    month = _month(conn)
    _locked_month(conn, session.tenant_id, month)
    _add(conn, session.tenant_id, month, settled_micro_usd=total,
         settled_tokens=sum(counts.values()))  # fmt: skip
    _add_session(conn, session.id, spent_micro_usd=total)
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
    for r in sorted(rows, key=lambda r: (r.tenant_id, r.month)):  # one lock order for all
        _locked_month(conn, r.tenant_id, r.month)
        _add(conn, r.tenant_id, r.month, reserved_micro_usd=-r.micro_usd,
             reserved_tokens=-r.tokens)  # fmt: skip
        _add_session(conn, r.session_id, reserved_micro_usd=-r.micro_usd)
    return sum(r.micro_usd for r in rows)


def _add(conn: sa.Connection, tenant_id: str, month: date, **deltas: int) -> None:
    conn.execute(
        sa.update(tenant_months)
        .where(tenant_months.c.tenant_id == tenant_id, tenant_months.c.month == month)
        .values({name: tenant_months.c[name] + delta for name, delta in deltas.items()})
    )


def _add_session(conn: sa.Connection, session_id: str, **deltas: int) -> None:
    conn.execute(
        sa.update(sessions)
        .where(sessions.c.id == session_id)
        .values({name: sessions.c[name] + delta for name, delta in deltas.items()})
    )
