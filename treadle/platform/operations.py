"""Operations: admission (append OperationRequested, dedupe by seq_id) and settlement.

Admission appends `OperationRequested` and the `operations` row in one transaction; the caller
enqueues the wake-up only after commit. A resent (session, seq_id) returns the same request id; a
different payload under a used seq_id is refused. Settlement appends `OperationCompleted` or
`OperationFailed` in one transaction guarded by the worker's lease epoch.
Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from treadle.platform import events
from treadle.platform.errors import ConflictError, NotFoundError, ValidationError
from treadle.platform.schema import operations, sessions
from treadle.platform.sessions import get_session
from treadle.platform.tenants import Principal

TRAINING_TYPES = (
    "create_model",
    "forward_backward",
    "optim_step",
    "save_weights_for_sampler",
    "save_weights",
    "load_weights",
)
SAMPLE_TYPES = ("sample",)


class StaleLeaseError(Exception):
    """The worker's lease epoch is no longer current: its write is refused."""


@dataclass(frozen=True)
class Admission:
    request_id: str
    session_id: str
    is_new: bool


@dataclass(frozen=True)
class OperationRow:
    request_id: str
    tenant_id: str
    session_id: str
    sampler_id: str | None
    seq_id: int
    type: str
    status: str
    request_position: int
    result: Any
    error: Any

    @property
    def is_done(self) -> bool:
        return self.status != "pending"


def payload_hash(payload: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def admit(
    conn: sa.Connection,
    principal: Principal,
    session_id: str,
    seq_id: int,
    op_type: str,
    payload: Mapping[str, Any],
    *,
    sampler_id: str | None = None,
) -> Admission:
    """Append an operation request (or find the identical one already appended)."""
    assert op_type in TRAINING_TYPES + SAMPLE_TYPES, op_type
    if seq_id < 0:
        raise ValidationError(f"seq_id must be >= 0, got {seq_id}")
    session = get_session(conn, principal, session_id, for_update=True)
    digest = payload_hash(payload)
    key = operations.c.sampler_id == sampler_id if sampler_id else operations.c.sampler_id.is_(None)
    existing = conn.execute(
        sa.select(operations.c.request_id, operations.c.payload_hash, operations.c.type).where(
            operations.c.session_id == session_id, operations.c.seq_id == seq_id, key
        )
    ).first()
    if existing is not None:
        if existing.payload_hash != digest or existing.type != op_type:
            raise ConflictError(
                f"seq_id {seq_id} of {sampler_id or session_id} was already used by a different "
                f"{existing.type} request; each operation needs the next unused seq_id"
            )
        return Admission(existing.request_id, session_id, is_new=False)
    if not session.is_active:
        raise ValidationError(
            f"model {session_id} is {session.status}; create a new training client to continue"
        )
    if sampler_id is None and seq_id <= session.last_applied_seq:
        raise ValidationError(
            f"seq_id {seq_id} of {session_id} is behind the last applied operation "
            f"({session.last_applied_seq}); training operations must use increasing seq_ids"
        )
    request_id = "req-" + uuid.uuid4().hex
    event = events.append(
        conn,
        session_id,
        principal.tenant_id,
        "OperationRequested",
        {
            "request_id": request_id,
            "seq_id": seq_id,
            "type": op_type,
            "sampler_id": sampler_id,
            "payload": dict(payload),
        },
        actor=principal.key_id,
    )
    conn.execute(
        operations.insert().values(
            request_id=request_id,
            tenant_id=principal.tenant_id,
            session_id=session_id,
            sampler_id=sampler_id,
            seq_id=seq_id,
            type=op_type,
            status="pending",
            payload_hash=digest,
            request_position=event.position,
        )
    )
    return Admission(request_id, session_id, is_new=True)


def get_operation(
    conn: sa.Connection, principal: Principal | None, request_id: str
) -> OperationRow:
    query = sa.select(operations).where(operations.c.request_id == request_id)
    if principal is not None:
        query = query.where(operations.c.tenant_id == principal.tenant_id)
    row = conn.execute(query).first()
    if row is None:
        raise NotFoundError(f"request {request_id} not found")
    return _row(row)


def pending_training_op(conn: sa.Connection, session_id: str, seq_id: int) -> OperationRow | None:
    row = conn.execute(
        sa.select(operations).where(
            operations.c.session_id == session_id,
            operations.c.sampler_id.is_(None),
            operations.c.seq_id == seq_id,
        )
    ).first()
    return None if row is None else _row(row)


def completed_training_ops(
    conn: sa.Connection, session_id: str, up_to_seq: int
) -> list[OperationRow]:
    rows = conn.execute(
        sa.select(operations)
        .where(
            operations.c.session_id == session_id,
            operations.c.sampler_id.is_(None),
            operations.c.seq_id <= up_to_seq,
            operations.c.status == "completed",
        )
        .order_by(operations.c.seq_id)
    )
    return [_row(r) for r in rows]


def settle(
    conn: sa.Connection,
    op: OperationRow,
    *,
    worker_id: str,
    lease_epoch: int,
    result: Mapping[str, Any] | None,
    error: Mapping[str, Any] | None,
    usage: Mapping[str, Any],
    also: Callable[[sa.Connection], None] | None = None,
) -> bool:
    """Record an operation's outcome. Returns False when it had already been settled (duplicate).

    Raises StaleLeaseError when this worker no longer holds the session's lease at `lease_epoch`.
    `also` runs inside the same transaction when the operation succeeded (e.g. registering the
    checkpoint it saved).
    """
    session = get_session(conn, None, op.session_id, for_update=True)
    if session.worker_id != worker_id or session.lease_epoch != lease_epoch:
        raise StaleLeaseError(
            f"{worker_id} epoch {lease_epoch} no longer holds {op.session_id} "
            f"({session.worker_id} epoch {session.lease_epoch} does)"
        )
    current = get_operation(conn, None, op.request_id)
    if current.is_done:
        return False
    if op.sampler_id is None:
        if session.last_applied_seq != op.seq_id - 1:
            raise StaleLeaseError(
                f"{op.session_id}: seq {op.seq_id} settled out of order "
                f"(last applied {session.last_applied_seq})"
            )
        conn.execute(
            sa.update(sessions)
            .where(sessions.c.id == op.session_id)
            .values(
                last_applied_seq=op.seq_id,
                status=sa.case(
                    (sessions.c.status == "Created", "Running"), else_=sessions.c.status
                ),
            )
        )
    data = {"request_id": op.request_id, "seq_id": op.seq_id, "type": op.type, **usage}
    if error is None:
        events.append(
            conn, op.session_id, op.tenant_id, "OperationCompleted", {**data, "result": result}
        )
        if also is not None:
            also(conn)
    else:
        events.append(
            conn, op.session_id, op.tenant_id, "OperationFailed", {**data, "error": error}
        )
    conn.execute(
        sa.update(operations)
        .where(operations.c.request_id == op.request_id)
        .values(
            status="completed" if error is None else "failed",
            result=result,
            error=error,
            completed_at=sa.func.now(),
        )
    )
    return True


def _row(row: sa.Row[Any]) -> OperationRow:
    return OperationRow(
        request_id=row.request_id,
        tenant_id=row.tenant_id,
        session_id=row.session_id,
        sampler_id=row.sampler_id,
        seq_id=row.seq_id,
        type=row.type,
        status=row.status,
        request_position=row.request_position,
        result=row.result,
        error=row.error,
    )


def oldest_pending_training_op(conn: sa.Connection, session_id: str) -> tuple[int, float] | None:
    """(seq_id, age in seconds) of the lowest pending training operation, if any."""
    row = conn.execute(
        sa.select(
            operations.c.seq_id,
            sa.func.extract("epoch", sa.func.now() - operations.c.created_at).label("age"),
        )
        .where(
            operations.c.session_id == session_id,
            operations.c.sampler_id.is_(None),
            operations.c.status == "pending",
        )
        .order_by(operations.c.seq_id)
        .limit(1)
    ).first()
    return None if row is None else (int(row.seq_id), float(row.age))


def stale_pending(
    conn: sa.Connection, session_ids: list[str], min_age: float
) -> list[tuple[str, str]]:
    """(session id, request id) of pending operations older than `min_age` seconds."""
    if not session_ids:
        return []
    rows = conn.execute(
        sa.select(operations.c.session_id, operations.c.request_id)
        .where(
            operations.c.session_id.in_(session_ids),
            operations.c.status == "pending",
            operations.c.created_at
            < sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, min_age),
        )
        .order_by(operations.c.session_id, operations.c.seq_id)
    )
    return [(r.session_id, r.request_id) for r in rows]


def skip_gap(
    conn: sa.Connection, session_id: str, worker_id: str, lease_epoch: int, to_seq: int
) -> bool:
    """Give up waiting for seq_ids that never arrived (a request the client failed to deliver)."""
    session = get_session(conn, None, session_id, for_update=True)
    if session.worker_id != worker_id or session.lease_epoch != lease_epoch:
        return False
    if session.last_applied_seq >= to_seq - 1:
        return False
    conn.execute(
        sa.update(sessions).where(sessions.c.id == session_id).values(last_applied_seq=to_seq - 1)
    )
    events.append(
        conn,
        session_id,
        session.tenant_id,
        "OperationsSkipped",
        {
            "from_seq": session.last_applied_seq + 1,
            "to_seq": to_seq - 1,
            "reason": "these seq_ids were never received; later operations went ahead",
        },
    )
    return True


def fail_pending(conn: sa.Connection, session_id: str, reason: str) -> list[str]:
    """Fail every pending operation of a stopped session, so no client waits on it forever.

    A worker finishing one of them concurrently finds it settled and drops its result.
    """
    rows = conn.execute(
        sa.select(operations)
        .where(operations.c.session_id == session_id, operations.c.status == "pending")
        .order_by(operations.c.seq_id)
        .with_for_update()
    ).all()
    error = {"category": "user", "code": "session_stopped", "message": reason}
    for row in rows:
        events.append(
            conn,
            session_id,
            row.tenant_id,
            "OperationFailed",
            {"request_id": row.request_id, "seq_id": row.seq_id, "type": row.type, "error": error},
        )
    if rows:
        conn.execute(
            sa.update(operations)
            .where(operations.c.request_id.in_([r.request_id for r in rows]))
            .values(status="failed", error=error, completed_at=sa.func.now())
        )
    return [r.request_id for r in rows]
