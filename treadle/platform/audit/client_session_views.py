"""Read-only views of a tenant's client sessions (Tinker "sessions"): the ids page, one session's
training runs and samplers, and the search with its filters and (created_at, id) cursor.

Every query is scoped by tenant; `Scope.OWNED` narrows it to the sessions the caller's key
opened (`client_sessions.created_by`). Another tenant's session answers exactly like a missing
one. Writes nothing. Imports nothing from api, engine, worker, Flask or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa

from treadle.platform.errors import NotFoundError
from treadle.platform.eventlog.schema import checkpoints, client_sessions, samplers, sessions
from treadle.platform.sessions.sessions import ClientSessionStatus
from treadle.platform.tenancy.tenants import Principal


class Scope(StrEnum):
    """Whose client sessions a lookup sees: the caller's key's own, or its whole tenant's."""

    OWNED = "owned"
    ACCESSIBLE = "accessible"


@dataclass(frozen=True)
class ClientSessionDetail:
    id: str
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: Mapping[str, Any]
    display_name: str | None = None


@dataclass(frozen=True)
class ClientSessionSummary:
    id: str
    tenant_id: str
    created_at: datetime
    created_by: str | None
    status: str  # a ClientSessionStatus value
    user_metadata: Mapping[str, Any]
    checkpoints_count: int
    checkpoint_storage_bytes: int
    display_name: str | None = None


@dataclass(frozen=True)
class Search:
    """A search: every filter given must hold (`session_id` OR the display name, as Tinker's).

    `statuses` None matches every status (an empty tuple matches none); `owners` None matches
    every key of the tenant. `after` is the cursor: (created_at, id) of the previous page's last.
    """

    limit: int
    session_id: str | None = None
    display_words: tuple[str, ...] = ()
    user_metadata: Mapping[str, str] = field(default_factory=dict)
    statuses: tuple[ClientSessionStatus, ...] | None = None
    owners: tuple[str, ...] | None = None
    after: tuple[datetime, str] | None = None


def _scoped(principal: Principal, scope: Scope) -> list[sa.ColumnElement[bool]]:
    where = [client_sessions.c.tenant_id == principal.tenant_id]
    if scope == Scope.OWNED:
        where.append(client_sessions.c.created_by == principal.key_id)
    return where


def list_ids(
    conn: sa.Connection, principal: Principal, *, scope: Scope, limit: int, offset: int
) -> list[str]:
    """One page of the client session ids the caller sees, newest first."""
    rows = conn.execute(
        sa.select(client_sessions.c.id)
        .where(*_scoped(principal, scope))
        .order_by(client_sessions.c.created_at.desc(), client_sessions.c.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return [str(r) for r in rows.scalars()]


def get(
    conn: sa.Connection, principal: Principal, session_id: str, *, scope: Scope
) -> ClientSessionDetail:
    """A client session with its training runs and samplers, oldest first; NotFoundError for
    one the caller does not see (missing, another tenant's, or not its key's with OWNED)."""
    row = conn.execute(
        sa.select(
            client_sessions.c.id, client_sessions.c.user_metadata, client_sessions.c.display_name
        ).where(client_sessions.c.id == session_id, *_scoped(principal, scope))
    ).first()
    if row is None:
        hint = (
            "; with access_scope=owned only the sessions your key created are found: pass "
            "access_scope=accessible for every session of your tenant"
            if scope == Scope.OWNED
            else ""
        )
        raise NotFoundError(f"session {session_id} not found{hint}")
    runs = conn.execute(
        sa.select(sessions.c.id)
        .where(
            sessions.c.client_session_id == session_id,
            sessions.c.tenant_id == principal.tenant_id,
            sessions.c.kind == "training",
        )
        .order_by(sessions.c.created_at, sessions.c.id)
    ).scalars()
    sampler_ids = conn.execute(
        sa.select(samplers.c.id)
        .where(
            samplers.c.client_session_id == session_id,
            samplers.c.tenant_id == principal.tenant_id,
        )
        .order_by(samplers.c.created_at, samplers.c.id)
    ).scalars()
    return ClientSessionDetail(
        id=row.id,
        training_run_ids=list(runs),
        sampler_ids=list(sampler_ids),
        user_metadata=row.user_metadata or {},
        display_name=row.display_name,
    )


def search(
    conn: sa.Connection, principal: Principal, query: Search
) -> tuple[list[ClientSessionSummary], bool]:
    """One page of the tenant's client sessions matching `query`, newest first, and whether
    more follow it."""
    cs = client_sessions.c
    where: list[sa.ColumnElement[bool]] = [cs.tenant_id == principal.tenant_id]
    matches = []
    if query.session_id is not None:
        matches.append(cs.id == query.session_id)
    if query.display_words:  # every word, case-insensitively, anywhere in the name
        matches.append(
            sa.and_(
                *(
                    cs.display_name.ilike("%" + _escape_like(word) + "%", escape="\\")
                    for word in query.display_words
                )
            )
        )
    if matches:
        where.append(sa.or_(*matches))
    for key, value in query.user_metadata.items():
        where.append(cs.user_metadata.op("->>")(key) == value)
    if query.statuses is not None:
        where.append(cs.status.in_([str(s) for s in query.statuses]))
    if query.owners is not None:
        where.append(cs.created_by.in_(query.owners))
    if query.after is not None:
        where.append(sa.tuple_(cs.created_at, cs.id) < sa.tuple_(*query.after))
    rows = conn.execute(
        sa.select(cs.id, cs.created_at, cs.created_by, cs.status, cs.user_metadata, cs.display_name)
        .where(*where)
        .order_by(cs.created_at.desc(), cs.id.desc())
        .limit(query.limit + 1)
    ).all()
    more = len(rows) > query.limit
    rows = rows[: query.limit]
    storage = _checkpoint_storage(conn, principal, [r.id for r in rows])
    return [
        ClientSessionSummary(
            id=r.id,
            tenant_id=principal.tenant_id,
            created_at=r.created_at,
            created_by=r.created_by,
            status=str(r.status),
            user_metadata=r.user_metadata or {},
            checkpoints_count=storage.get(r.id, (0, 0))[0],
            checkpoint_storage_bytes=storage.get(r.id, (0, 0))[1],
            display_name=r.display_name,
        )
        for r in rows
    ], more


def _escape_like(word: str) -> str:
    return word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _checkpoint_storage(
    conn: sa.Connection, principal: Principal, ids: Sequence[str]
) -> dict[str, tuple[int, int]]:
    """(live checkpoints, their bytes) of each client session's training runs."""
    if not ids:
        return {}
    rows = conn.execute(
        sa.select(
            sessions.c.client_session_id,
            sa.func.count(checkpoints.c.id),
            sa.func.coalesce(sa.func.sum(checkpoints.c.size_bytes), 0),
        )
        .select_from(checkpoints.join(sessions, sessions.c.id == checkpoints.c.session_id))
        .where(
            checkpoints.c.tenant_id == principal.tenant_id,
            sessions.c.client_session_id.in_(ids),
            checkpoints.c.deleted_at.is_(None),
            sa.or_(checkpoints.c.expires_at.is_(None), checkpoints.c.expires_at > sa.func.now()),
        )
        .group_by(sessions.c.client_session_id)
    )
    return {r[0]: (int(r[1]), int(r[2])) for r in rows}
