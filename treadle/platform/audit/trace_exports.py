"""Trace exports of client sessions: download tokens, and the operations a trace is built from.

`issue` checks the caller's tenant holds the client session and mints a random token, good for
TOKEN_TTL; only its SHA-256 is stored (`trace_exports`), so the table cannot be used to download
anything. `redeem` finds a live token's client session and builds its trace (`traces.build`) as
of that moment, scoped to the tenant that issued it. Imports nothing from api, engine, worker, Flask
or torch.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from treadle.platform.audit import traces
from treadle.platform.errors import NotFoundError
from treadle.platform.eventlog.schema import (
    client_sessions,
    operations,
    sessions,
    trace_exports,
    usage,
)
from treadle.platform.tenancy.tenants import Principal

TOKEN_TTL = timedelta(hours=1)
MAX_TOKEN_LENGTH = 128


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


def issue(conn: sa.Connection, principal: Principal, client_session_id: str) -> str:
    """A new download token for the trace of one of the tenant's client sessions."""
    found = conn.execute(
        sa.select(client_sessions.c.id).where(
            client_sessions.c.id == client_session_id,
            client_sessions.c.tenant_id == principal.tenant_id,
        )
    ).first()
    if found is None:
        raise NotFoundError(
            f"session {client_session_id} not found; list yours with RestClient.list_sessions"
        )
    conn.execute(  # the tenant's expired tokens: nothing can use them any more
        sa.delete(trace_exports).where(
            trace_exports.c.tenant_id == principal.tenant_id,
            trace_exports.c.expires_at < sa.func.now(),
        )
    )
    token = secrets.token_urlsafe(32)
    conn.execute(
        trace_exports.insert().values(
            token_hash=_hash(token),
            tenant_id=principal.tenant_id,
            client_session_id=client_session_id,
            created_by=principal.key_id,
            expires_at=sa.func.now() + TOKEN_TTL,
        )
    )
    return token


def redeem(conn: sa.Connection, token: str) -> bytes:
    """The trace file a live token names; NotFoundError for an unknown or expired one."""
    row = None
    if len(token) <= MAX_TOKEN_LENGTH:  # a longer one was never issued: no need to look
        row = conn.execute(
            sa.select(trace_exports.c.tenant_id, trace_exports.c.client_session_id).where(
                trace_exports.c.token_hash == _hash(token),
                trace_exports.c.expires_at > sa.func.now(),
            )
        ).first()
    if row is None:
        raise NotFoundError(
            "this trace link is unknown or has expired (links last "
            f"{TOKEN_TTL.total_seconds() / 3600:g} hour); export the trace again for a new one: "
            "tinker session export-trace <session id>"
        )
    origin = conn.execute(
        sa.select(client_sessions.c.created_at).where(
            client_sessions.c.id == row.client_session_id,
            client_sessions.c.tenant_id == row.tenant_id,
        )
    ).scalar_one()
    ops = load_operations(conn, row.tenant_id, row.client_session_id)
    trace = traces.build(row.client_session_id, origin, ops, datetime.now(UTC))
    return traces.encode(trace)


def load_operations(
    conn: sa.Connection, tenant_id: str, client_session_id: str
) -> list[traces.TracedOperation]:
    """Every training and sampling operation of the client session, with its tokens."""
    rows = conn.execute(
        sa.select(
            operations.c.request_id,
            operations.c.session_id,
            operations.c.sampler_id,
            operations.c.seq_id,
            operations.c.type,
            operations.c.status,
            operations.c.created_at,
            operations.c.completed_at,
            usage.c.prefill_tokens,
            usage.c.sample_tokens,
            usage.c.train_tokens,
        )
        .select_from(
            operations.join(sessions, sessions.c.id == operations.c.session_id).outerjoin(
                usage, usage.c.request_id == operations.c.request_id
            )
        )
        .where(
            operations.c.tenant_id == tenant_id,
            sessions.c.tenant_id == tenant_id,
            sessions.c.client_session_id == client_session_id,
        )
        .order_by(operations.c.created_at, operations.c.request_id)
    )
    return [
        traces.TracedOperation(
            request_id=r.request_id,
            track=r.sampler_id or r.session_id,
            seq_id=r.seq_id,
            type=r.type,
            status=r.status,
            created_at=r.created_at,
            completed_at=r.completed_at,
            tokens=None
            if r.train_tokens is None
            else {"prefill": r.prefill_tokens, "sample": r.sample_tokens, "train": r.train_tokens},
        )
        for r in rows
    ]
