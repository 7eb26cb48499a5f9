"""The session listing of a tenant (or, for the operator, of any or every tenant): each
session's owner, status, worker and activity, with its operations, tokens and cost summed from
the usage ledger, one SQL query per page. Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, TypeGuard

import sqlalchemy as sa

from treadle.platform.audit.audit import check_limit
from treadle.platform.billing.prices import TOKEN_CLASSES
from treadle.platform.billing.usage import ALL_TENANTS, tenant_scope, usd
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog.schema import client_sessions, events, sessions, usage
from treadle.platform.sessions.sessions import SessionStatus
from treadle.platform.tenancy.tenants import Principal

_KIND = re.compile(r"^[a-z_]{1,32}$")


@dataclass(frozen=True)
class SessionSummary:
    """A session with its owner, activity and what it used (the ledger's sums: `operations`
    counts its completed operations, each of which has one usage row)."""

    id: str
    tenant_id: str
    name: str | None
    kind: str
    status: str
    base_model: str
    rank: int | None
    owner: str | None  # the key that created it
    worker_id: str | None
    created_at: datetime
    last_active_at: datetime
    operations: int
    tokens: Mapping[str, int]
    cost_micro_usd: int
    source_session_id: str | None = None
    source_seq: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model_id": self.id}
        out.update((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "id")
        out.pop("tokens")
        out.update(created_at=_iso(self.created_at), last_active_at=_iso(self.last_active_at))
        out.update({f"{c}_tokens": self.tokens[c] for c in TOKEN_CLASSES})
        return {
            **out,
            "total_tokens": sum(self.tokens.values()),
            "cost_usd": usd(self.cost_micro_usd),
        }


@dataclass(frozen=True)
class SessionListing:
    tenant_id: str  # or ALL_TENANTS
    sessions: list[SessionSummary]
    next_offset: int | None  # None: this was the last page


def check_status(status: str) -> str:
    """A session status, case-insensitively; a 400 listing them otherwise."""
    for known in SessionStatus:
        if status.lower() == known.value.lower():
            return known.value
    raise ValidationError(
        f"unknown session status {status!r}; use one of {', '.join(s.value for s in SessionStatus)}"
    )


def list_sessions(
    conn: sa.Connection,
    principal: Principal,
    *,
    tenant: str | None = None,
    status: str | None = None,
    kind: str | None = None,
    since: datetime | None = None,
    limit: int = 50,
    offset: int = 0,
) -> SessionListing:
    """One page of sessions, newest first, in one query: the page's sessions joined with
    their owner, last event and ledger sums. `tenant`: the caller's own by default; another
    (or ALL_TENANTS) only for the operator (403 for anyone else)."""
    check_limit(limit)
    if offset < 0:
        raise ValidationError(f"offset must be >= 0, got {offset}")
    if kind is not None and not _KIND.match(kind):
        raise ValidationError(
            f"kind {kind!r} is not a session kind; use training, sampling or replay (a fork is a training session with a source)"
        )
    if since is not None and since.tzinfo is None:
        raise ValidationError("since needs a time zone (e.g. 2026-11-01T00:00:00Z)")
    scope = tenant_scope(conn, principal, tenant, allow_all=True)
    where = []
    if scope != ALL_TENANTS:
        where.append(sessions.c.tenant_id == scope)
    if status is not None:
        where.append(sessions.c.status == check_status(status))
    if kind is not None:
        where.append(sessions.c.kind == kind)
    if since is not None:
        where.append(sessions.c.created_at >= since)
    newest_first = (sessions.c.created_at.desc(), sessions.c.id.desc())
    page = (
        sa.select(sessions)
        .where(*where)
        .order_by(*newest_first)
        .limit(limit + 1)
        .offset(offset)
        .subquery("page")
    )
    creator = (
        sa.select(events.c.actor)
        .where(events.c.session_id == page.c.id, events.c.type == "SessionCreated")
        .order_by(events.c.seq)
        .limit(1)
        .scalar_subquery()
    )
    opener = (
        sa.select(client_sessions.c.created_by)
        .where(client_sessions.c.id == page.c.client_session_id)
        .scalar_subquery()
    )
    last_event = (
        sa.select(events.c.created_at)
        .where(events.c.session_id == page.c.id, events.c.seq == page.c.last_event_seq)
        .scalar_subquery()
    )
    ledger = (
        sa.select(
            sa.func.count().label("operations"),
            *(
                sa.func.coalesce(sa.func.sum(usage.c[f"{c}_tokens"]), 0).label(f"{c}_tokens")
                for c in TOKEN_CLASSES
            ),
            sa.func.coalesce(sa.func.sum(usage.c.cost_micro_usd), 0).label("cost_micro_usd"),
        )
        .where(usage.c.session_id == page.c.id)
        .lateral("ledger")
    )
    query = (
        sa.select(
            page,
            sa.func.coalesce(creator, opener).label("owner"),
            sa.func.coalesce(last_event, page.c.updated_at).label("last_active_at"),
            *ledger.c,
        )
        .select_from(page.join(ledger, sa.true()))
        .order_by(page.c.created_at.desc(), page.c.id.desc())
    )
    rows = conn.execute(query).all()
    found = [_summary(r) for r in rows[:limit]]
    return SessionListing(scope, found, offset + limit if len(rows) > limit else None)


def _summary(r: Any) -> SessionSummary:
    rank = (r.lora_config or {}).get("rank")
    return SessionSummary(
        id=r.id,
        tenant_id=r.tenant_id,
        name=r.name,
        kind=r.kind,
        status=r.status,
        base_model=r.base_model,
        rank=int(rank) if _number(rank) else None,
        owner=r.owner,
        worker_id=r.worker_id,
        created_at=r.created_at,
        last_active_at=max(r.last_active_at, r.updated_at),
        operations=int(r.operations),
        tokens={c: int(getattr(r, f"{c}_tokens")) for c in TOKEN_CLASSES},
        cost_micro_usd=int(r.cost_micro_usd),
        source_session_id=r.source_session_id,
        source_seq=r.source_seq,
    )


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()
