"""Failing operations before they run: every pending one of a stopped, expired or diverged
session (`fail_pending`), or one a client cancels (`cancel`). Each appends `OperationFailed`,
marks the row failed and releases the operation's metering reservation in the caller's
transaction. Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import sqlalchemy as sa

from treadle.platform.billing import metering as metering_core
from treadle.platform.errors import ConflictError, ValidationError
from treadle.platform.eventlog import events
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.eventlog.schema import operations, refused_seqs
from treadle.platform.operations.operations import CANCELLED, OperationRow, get_operation
from treadle.platform.sessions.sessions import get_session
from treadle.platform.tenancy.tenants import Principal


def fail_pending(
    conn: sa.Connection,
    session_id: str,
    reason: str,
    *,
    code: str = "session_stopped",
    category: str = "user",
    actor: str | None = None,
) -> list[str]:
    """Fail every pending operation of a stopped (or diverged) session, so no client waits on it
    forever. A worker finishing one of them concurrently finds it settled and drops its result.
    """
    rows = conn.execute(
        sa.select(operations)
        .where(operations.c.session_id == session_id, operations.c.status == OpStatus.PENDING)
        .order_by(operations.c.seq_id)
        .with_for_update()
    ).all()
    error = {"category": category, "code": code, "message": reason}
    for row in rows:
        events.append(
            conn,
            session_id,
            row.tenant_id,
            "OperationFailed",
            {"request_id": row.request_id, "seq_id": row.seq_id, "type": row.type, "error": error},
            actor=actor,
        )
    if rows:
        conn.execute(
            sa.update(operations)
            .where(operations.c.request_id.in_([r.request_id for r in rows]))
            .values(status=OpStatus.FAILED, error=error, completed_at=sa.func.now())
        )
        metering_core.release(conn, [r.request_id for r in rows])
    return [r.request_id for r in rows]


def cancel(conn: sa.Connection, principal: Principal, request_id: str) -> OperationRow:
    """Fail the caller's pending operation `request_id` in place (category user, message
    "cancelled") and release its reservation. A training operation's seq_id is passed over like
    a refused one, so the session's next operation runs at once; a worker running the operation
    now finds it settled, stops it at its next step boundary (its lease keeper checks every
    heartbeat) and drops its result. Holds the session row's lock, as admission and settlement
    do, so it never races either.

    Raises NotFoundError (another tenant's request too), ConflictError once it is settled, and
    ValidationError for a model's seq 0 (the operation that creates it: stop the model instead).
    """
    op = get_operation(conn, principal, request_id)
    get_session(conn, None, op.session_id, for_update=True)
    op = get_operation(conn, None, request_id)
    if op.is_done:
        raise ConflictError(
            f"request {request_id} has {op.status} already; only a pending request can be "
            "cancelled (read its result with retrieve_future)"
        )
    if op.sampler_id is None and op.seq_id == 0:
        raise ValidationError(
            f"request {request_id} creates model {op.session_id} (its seq_id 0) and cannot be "
            f"cancelled alone; stop the model instead: POST /api/v1/treadle/sessions/"
            f"{op.session_id}/stop"
        )
    error = {"category": "user", "code": CANCELLED, "message": "cancelled"}
    events.append(
        conn,
        op.session_id,
        op.tenant_id,
        "OperationFailed",
        {"request_id": op.request_id, "seq_id": op.seq_id, "type": op.type, "error": error},
        actor=principal.key_id,
    )
    conn.execute(
        sa.update(operations)
        .where(operations.c.request_id == request_id)
        .values(status=OpStatus.FAILED, error=error, completed_at=sa.func.now())
    )
    metering_core.release(conn, [request_id])
    if op.sampler_id is None:
        stmt = sa.dialects.postgresql.insert(refused_seqs).values(
            session_id=op.session_id, seq_id=op.seq_id
        )
        conn.execute(stmt.on_conflict_do_nothing())
    return get_operation(conn, None, request_id)
