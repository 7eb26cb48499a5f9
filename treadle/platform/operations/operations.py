"""Operations: admission (append OperationRequested, dedupe by seq_id) and settlement.

Admission appends `OperationRequested` and the `operations` row in one transaction; the caller
enqueues the wake-up only after commit. A resent (session, seq_id) returns the same request id; a
different payload under a used seq_id is refused. A training seq_id refused at admission is
remembered (not logged: a refused request appends no event), and the worker applies the next
operation after it at once, as if the refused seq_id had never been reserved. A pending operation
cancelled by its client (`cancellation.cancel`) fails in place and its training seq_id is passed over the same
way. Settlement appends `OperationCompleted` (with the state hashes of a state-changing operation)
or `OperationFailed` in one transaction guarded by the worker's lease epoch.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from treadle.platform import metrics
from treadle.platform.billing import metering as metering_core
from treadle.platform.billing import prices
from treadle.platform.billing.quotas import Quota, quota_from_row
from treadle.platform.errors import (
    ConflictError,
    InactiveSessionError,
    NotFoundError,
    ValidationError,
)
from treadle.platform.eventlog import events
from treadle.platform.eventlog.optypes import OpStatus, OptimStep, OpType, Payload
from treadle.platform.eventlog.schema import events as event_rows
from treadle.platform.eventlog.schema import operations, refused_seqs, sessions
from treadle.platform.eventlog.schema import quotas as quota_rows
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.sessions.leases import StaleLeaseError, check_holder, hold
from treadle.platform.sessions.sessions import SessionStatus, expired_message, get_session
from treadle.platform.tenancy.tenants import Principal

# The error code of an operation its client cancelled before it finished (`cancel`).
CANCELLED = "request_cancelled"

# Statements built once: they run in every admission, every worker read and every settlement,
# where building a statement took more CPU than PostgreSQL takes to run it.
_BY_REQUEST = sa.select(operations).where(operations.c.request_id == sa.bindparam("request_id"))
_BY_REQUEST_OF_TENANT = _BY_REQUEST.where(operations.c.tenant_id == sa.bindparam("tenant_id"))
_AT_SEQ = (
    operations.c.session_id == sa.bindparam("session_id"),
    operations.c.seq_id == sa.bindparam("seq_id"),
)
_UNREFUSE = sa.delete(refused_seqs).where(
    refused_seqs.c.session_id == sa.bindparam("session_id"),
    refused_seqs.c.seq_id == sa.bindparam("seq_id"),
)
_USED_SEQ = {  # is it a sampler's: the operation already at (session, seq_id)
    # A training seq_id refused at admission and sent again is now acceptable: it is no hole
    # (deleted in the same statement; a refusal below rolls that back with the rest).
    False: sa.select(operations.c.request_id, operations.c.payload_hash, operations.c.type)
    .where(*_AT_SEQ, operations.c.sampler_id.is_(None))
    .add_cte(_UNREFUSE.cte("unrefused")),
    True: sa.select(operations.c.request_id, operations.c.payload_hash, operations.c.type).where(
        *_AT_SEQ, operations.c.sampler_id == sa.bindparam("sampler_id")
    ),
}
_NOT_CANCELLED = sa.or_(
    operations.c.status != OpStatus.FAILED,
    operations.c.error["code"].astext.is_distinct_from(CANCELLED),
)
_TRAINING_OP_FROM = (
    sa.select(operations, event_rows.c.data["payload"].label("request_payload"))
    .join(event_rows, event_rows.c.position == operations.c.request_position)
    .where(
        operations.c.session_id == sa.bindparam("session_id"),
        operations.c.sampler_id.is_(None),
        operations.c.seq_id >= sa.bindparam("seq_id"),
        _NOT_CANCELLED,
    )
    .order_by(operations.c.seq_id)
    .limit(1)
)
# An admission's first read, with metering: the session row locked, its tenant's quota and the
# highest prices of its base model from now on, in one query.
_ADMITTING = (
    sa.select(
        sessions,
        *[c.label(f"quota_{c.name}") for c in quota_rows.c],
        prices.highest_from_now_json(sessions.c.base_model).label("admit_prices"),
    )
    .select_from(sessions.outerjoin(quota_rows, quota_rows.c.tenant_id == sessions.c.tenant_id))
    .where(
        sessions.c.id == sa.bindparam("session_id"),
        sessions.c.tenant_id == sa.bindparam("tenant_id"),
    )
    .with_for_update(of=sessions)
)
# A wake-up's one read: the session, and the operation woken for with its request's payload
# (NULLs when it is not there).
_WOKEN = (
    sa.select(
        *[c.label(f"op_{c.name}") for c in operations.c],
        event_rows.c.data["payload"].label("op_request_payload"),
    )
    .join(event_rows, event_rows.c.position == operations.c.request_position)
    .where(
        operations.c.request_id == sa.bindparam("request_id"),
        operations.c.session_id == sa.bindparam("session_id"),
    )
    .subquery("woken")
)
_WAKE = (
    sa.select(sessions, _WOKEN)
    .select_from(sessions.outerjoin(_WOKEN, sa.true()))
    .where(sessions.c.id == sa.bindparam("session_id"))
)
_OLDEST_PENDING = (
    sa.select(
        operations.c.seq_id,
        sa.func.extract("epoch", sa.func.now() - operations.c.created_at).label("age"),
    )
    .where(
        operations.c.session_id == sa.bindparam("session_id"),
        operations.c.sampler_id.is_(None),
        operations.c.status == OpStatus.PENDING,
    )
    .order_by(operations.c.seq_id)
    .limit(1)
)
# A settlement's first statement: lock the session row and read it (its lease is checked in
# Python: a stale holder gets StaleLeaseError), write the outcome only if the operation is still
# pending and the lease still holds (the statement both checks and writes), and say the lowest
# training seq_id still pending after this one (None: the worker has nothing more to look up;
# anything admitted later gets a wake-up of its own).
_HELD = sa.select(sessions).where(sessions.c.id == sa.bindparam("outcome_session_id"))
_HELD_CTE = _HELD.with_for_update().cte("held")
_CLAIMED = (
    sa.update(operations)
    .where(
        operations.c.request_id == sa.bindparam("outcome_request_id"),
        operations.c.status == OpStatus.PENDING,
        sa.exists().where(
            _HELD_CTE.c.worker_id == sa.bindparam("outcome_worker_id"),
            _HELD_CTE.c.lease_epoch == sa.bindparam("outcome_lease_epoch"),
        ),
    )
    .values(
        status=sa.bindparam("outcome_status"),
        result=sa.bindparam("outcome_result", type_=operations.c.result.type),
        error=sa.bindparam("outcome_error", type_=operations.c.error.type),
        state=sa.bindparam("outcome_state", type_=operations.c.state.type),
        completed_at=sa.func.now(),
    )
    .returning(operations.c.request_id)
    .cte("claimed")
)
_NEXT_PENDING = (
    sa.select(sa.func.min(operations.c.seq_id))
    .where(
        operations.c.session_id == sa.bindparam("outcome_session_id"),
        operations.c.sampler_id.is_(None),
        operations.c.status == OpStatus.PENDING,
        operations.c.seq_id > sa.bindparam("outcome_seq_id"),
    )
    .scalar_subquery()
)
_OUTCOME = sa.select(
    _HELD_CTE,
    sa.select(_CLAIMED.c.request_id).scalar_subquery().label("outcome_claimed"),
    _NEXT_PENDING.label("outcome_next_pending"),
    prices.in_effect_json(_HELD_CTE.c.base_model).label("outcome_prices"),
)
# The outcome's event, with a training operation's seq_id recorded as the session's last applied
# in the same update of the session row (the append locks and updates it anyway).
_APPLIED_SQL = events.append_sql(
    also_set=", last_applied_seq = %(applied_seq)s, "
    "status = CASE WHEN status = %(created)s THEN %(running)s ELSE status END"
)
_APPLIED = {"created": SessionStatus.CREATED.value, "running": SessionStatus.RUNNING.value}
# An admission's request event and its operation row, in one statement.
_REQUEST_SQL = events.append_sql(
    then="""
INSERT INTO operations (request_id, tenant_id, session_id, sampler_id, seq_id, type, status,
                        payload_hash, request_position, actor)
SELECT %(request_id)s, %(tenant_id)s, %(session_id)s, %(sampler_id)s, CAST(%(seq_id)s AS bigint),
       %(op_type)s, %(op_status)s, %(payload_hash)s, position, %(actor)s
FROM appended
RETURNING request_position
"""
)


@dataclass(frozen=True)
class Settlement:
    is_new: bool  # False: it had been settled already (a duplicate), nothing was written
    charge: metering_core.Charge | None = None  # what a completed operation was billed
    # The lowest training seq_id of the session still pending after this operation when it was
    # settled (None: none was; one admitted since gets a wake-up of its own).
    next_pending: int | None = None
    # The result as written (with what `also` added to it), for the completion notice.
    result: Mapping[str, Any] | None = None


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
    type: OpType
    status: OpStatus
    request_position: int
    result: Any
    error: Any
    state: Any = None  # state hashes recorded at completion, for a state-changing operation
    actor: str | None = None  # the key that requested it
    requested_at: datetime | None = None  # when it was admitted (the database's clock)

    @property
    def is_done(self) -> bool:
        return self.status != OpStatus.PENDING


# What JSONB's numbers read back differently: -0.0 (as 0.0; json.dumps writes floats as repr,
# so not the start of -0.05) and a float of 1e16 or more (written 1e+16, read back an int).
_NOT_KEPT = re.compile(r"-0\.0(?![0-9eE])|e\+")


@dataclass(frozen=True)
class Outcome:
    """What a long-poll of a settled operation answers: from its row (`of`), or from the
    completion notice its worker sent (`outcome_notice`, `outcome_of_notice`)."""

    type: OpType
    status: OpStatus
    result: Any
    error: Any

    @classmethod
    def of(cls, op: OperationRow) -> Outcome:
        return cls(op.type, op.status, op.result, op.error)


def outcome_notice(op_type: OpType, result: Any, error: Any, *, max_bytes: int) -> bytes | None:
    """An operation's outcome as `settle` was just given it, for its completion notice: JSON
    that reads back as the same values the database gives. None (a bare notice) where it would
    not (`_NOT_KEPT`), and, without encoding it, where it must be longer than `max_bytes`."""
    status = OpStatus.COMPLETED if error is None else OpStatus.FAILED
    fields = {"type": op_type, "status": status, "result": result, "error": error}
    if _longer_than(fields, max_bytes):  # a large result: its encoding would be thrown away
        return None
    try:
        text = json.dumps(fields, separators=(",", ":"))
    except (TypeError, ValueError):  # not JSON; then neither did settle store it
        return None
    if _NOT_KEPT.search(text):  # or a string that looks so: rare, and the database answers
        return None
    return text.encode()


_CONTAINERS = (dict, list, tuple)


def _longer_than(value: Any, max_bytes: int) -> bool:
    """Whether `value`'s JSON is surely longer than `max_bytes`: each element of a list or
    object in it takes at least two bytes (itself and a separator), so more than `max_bytes`
    // 2 elements cannot fit. Counts a container's elements before looking into them, and
    looks into a list only if its first element is a container (a list of numbers is not
    walked); a count that misses some is low, and the result is then encoded after all."""
    left, stack = max_bytes // 2, [value]
    while stack:
        item = stack.pop()
        children: Any = item.values() if isinstance(item, dict) else item
        left -= len(children)
        if left < 0:
            return True
        if isinstance(item, dict) or (children and isinstance(children[0], _CONTAINERS)):
            stack.extend(c for c in children if isinstance(c, _CONTAINERS))
    return False


def outcome_of_notice(notice: bytes) -> Outcome:
    fields = json.loads(notice)
    return Outcome(
        OpType(fields["type"]), OpStatus(fields["status"]), fields["result"], fields["error"]
    )


def payload_hash(payload: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


_PARAMS = {"adamw": "AdamParams", "dimuon": "DimuonParams"}
_CONFIGS = {"adamw": "AdamOptimizerConfig", "dimuon": "DimuonOptimizerConfig"}


def _check_optimizer(session_id: str, lora_config: Mapping[str, Any], given: str) -> None:
    """A step for another optimizer than the session was created with is a 400."""
    own = str(lora_config.get("optimizer", "adamw"))
    if given != own:
        raise ValidationError(
            f"model {session_id} was created with {own} ({_CONFIGS[own]}) and keeps it for "
            f"life; send {_PARAMS[own]} to optim_step, not {_PARAMS[given]} (to train with "
            f"{given}, create a training client with optimizer={_CONFIGS[given]}())"
        )


def admit(
    conn: sa.Connection,
    principal: Principal,
    session_id: str,
    seq_id: int,
    payload: Payload,
    *,
    sampler_id: str | None = None,
    metering: bool = True,
    on_quota: Callable[[Quota], None] | None = None,
) -> Admission:
    """Append an operation request (or find the identical one already appended). With
    `metering`, its most possible cost is reserved in the same transaction (or it is refused
    with a 402/413 and nothing is appended), and `on_quota` sees the tenant's quota as soon as
    it is read (the request rate is checked there)."""
    assert payload.is_ordered == (sampler_id is None), (payload.TYPE, sampler_id)
    op_type = payload.TYPE
    if seq_id < 0:
        raise ValidationError(f"seq_id must be >= 0, got {seq_id}")
    metered: tuple[Quota, dict[str, int]] | None = None  # the quota and prices, with metering
    if metering:
        row = conn.execute(
            _ADMITTING, {"session_id": session_id, "tenant_id": principal.tenant_id}
        ).first()
        if row is None:
            raise NotFoundError(f"model {session_id} not found")
        session = sessions_core.session_row(row)
        metered = quota_from_row(row, prefix="quota_"), prices.highest_from_json(row.admit_prices)
        if on_quota is not None:
            on_quota(metered[0])
    else:
        session = get_session(conn, principal, session_id, for_update=True)
    data = payload.to_json()
    digest = payload_hash(payload.identity())
    at = {"session_id": session_id, "seq_id": seq_id}
    existing = conn.execute(
        _USED_SEQ[bool(sampler_id)], {**at, "sampler_id": sampler_id} if sampler_id else at
    ).first()
    if existing is not None:
        if existing.payload_hash != digest or existing.type != op_type:
            metrics.count_conflict("seq_conflict")
            raise ConflictError(
                f"seq_id {seq_id} of {sampler_id or session_id} was already used by a different "
                f"{existing.type} request; each operation needs the next unused seq_id"
            )
        return Admission(existing.request_id, session_id, is_new=False)
    if session.status == SessionStatus.EXPIRED:
        raise InactiveSessionError(expired_message(session_id))
    if session.status in (SessionStatus.DIVERGED, SessionStatus.FAILED):
        what = "diverged from its log" if session.status == SessionStatus.DIVERGED else "failed"
        raise InactiveSessionError(
            f"model {session_id} {what} and was stopped (see its events); start a new training "
            "client from a saved checkpoint to continue"
        )
    if not session.is_active:
        raise InactiveSessionError(
            f"model {session_id} is {session.status}; create a new training client to continue"
        )
    if session.is_replay and payload.changes_state and op_type != OpType.REBUILD:
        raise ValidationError(
            f"model {session_id} is a replay of {session.source_session_id} and is read-only to "
            f"training calls ({op_type} changes its weights); sample from it, or fork the "
            f"source to train from there: `treadle fork {session.source_session_id} --at-seq "
            f"{session.source_seq}`"
        )
    if isinstance(payload, OptimStep):
        _check_optimizer(session_id, session.lora_config, payload.optimizer)
    if sampler_id is None and seq_id <= session.last_applied_seq:
        raise ValidationError(
            f"seq_id {seq_id} of {session_id} is behind the last applied operation "
            f"({session.last_applied_seq}); training operations must use increasing seq_ids"
        )
    request_id = "req-" + uuid.uuid4().hex
    events.append_then(
        conn,
        _REQUEST_SQL,
        session_id,
        principal.tenant_id,
        "OperationRequested",
        {
            "request_id": request_id,
            "seq_id": seq_id,
            "type": op_type,
            "sampler_id": sampler_id,
            "payload": data,
        },
        actor=principal.key_id,
        params={
            "request_id": request_id,
            "sampler_id": sampler_id,
            "seq_id": seq_id,
            "op_type": op_type.value,
            "op_status": OpStatus.PENDING.value,
            "payload_hash": digest,
        },
    )
    if metered is not None and not session.is_replay:  # a replay is never billed
        quota, highest = metered
        metering_core.reserve(conn, session, request_id, payload, quota=quota, price=highest)
    return Admission(request_id, session_id, is_new=True)


def get_operation(
    conn: sa.Connection, principal: Principal | None, request_id: str
) -> OperationRow:
    if principal is None:
        row = conn.execute(_BY_REQUEST, {"request_id": request_id}).first()
    else:
        row = conn.execute(
            _BY_REQUEST_OF_TENANT, {"request_id": request_id, "tenant_id": principal.tenant_id}
        ).first()
    if row is None:
        raise NotFoundError(f"request {request_id} not found")
    return _row(row)


def session_and_operation(
    conn: sa.Connection, session_id: str, request_id: str
) -> tuple[sessions_core.SessionRow, tuple[OperationRow, Any] | None]:
    """A session (unscoped: the platform's own read) and, if it is the session's, the operation
    `request_id` with its request's payload, in one query. Raises NotFoundError for an unknown
    session."""
    row = conn.execute(_WAKE, {"session_id": session_id, "request_id": request_id}).first()
    if row is None:
        raise NotFoundError(f"model {session_id} not found")
    session = sessions_core.session_row(row)
    if row.op_request_id is None:
        return session, None
    return session, (_row(row, prefix="op_"), row.op_request_payload)


def training_op_at(conn: sa.Connection, session_id: str, seq_id: int) -> OperationRow | None:
    """The session's training operation at `seq_id`, whatever its status, unless its client
    cancelled it before it was applied: that seq_id is passed over like a refused one."""
    row = conn.execute(
        sa.select(operations).where(*_AT_SEQ, operations.c.sampler_id.is_(None), _NOT_CANCELLED),
        {"session_id": session_id, "seq_id": seq_id},
    ).first()
    return None if row is None else _row(row)


def training_op_from(
    conn: sa.Connection, session_id: str, seq_id: int
) -> tuple[OperationRow, Any] | None:
    """The session's training operation with the lowest seq_id >= `seq_id` (passing over those
    their client cancelled, as `training_op_at` does) and its request's payload, in one query;
    None when there is none."""
    row = conn.execute(_TRAINING_OP_FROM, {"session_id": session_id, "seq_id": seq_id}).first()
    return None if row is None else (_row(row), row.request_payload)


def completed_training_ops(
    conn: sa.Connection, session_id: str, *, after_seq: int, up_to_seq: int
) -> list[OperationRow]:
    """The session's completed training operations with after_seq < seq_id <= up_to_seq."""
    rows = conn.execute(
        sa.select(operations)
        .where(
            operations.c.session_id == session_id,
            operations.c.sampler_id.is_(None),
            operations.c.seq_id > after_seq,
            operations.c.seq_id <= up_to_seq,
            operations.c.status == OpStatus.COMPLETED,
        )
        .order_by(operations.c.seq_id)
    )
    return [_row(r) for r in rows]


def durations(
    conn: sa.Connection, session_id: str, *, after_seq: int, up_to_seq: int
) -> dict[int, float]:
    """Seconds each completed training operation with after_seq < seq_id <= up_to_seq took when
    it ran (its OperationCompleted's duration), by seq_id."""
    data = event_rows.c.data
    seq = sa.cast(data["seq_id"].astext, sa.BigInteger)
    rows = conn.execute(
        sa.select(seq, data["duration_ms"].astext).where(
            event_rows.c.session_id == session_id,
            event_rows.c.type == "OperationCompleted",
            data["type"].astext != OpType.SAMPLE,  # a sample's seq_id is its sampler's
            seq > after_seq,
            seq <= up_to_seq,
        )
    )
    return {int(r[0]): float(r[1] or 0) / 1000 for r in rows}


def snapshot_seq(conn: sa.Connection, session_id: str, snapshot_id: str) -> int | None:
    """The seq_id of the completed save_weights_for_sampler that last wrote `snapshot_id` (a
    sampler's own snapshot is written once; the session's inflight one at every inflight save)."""
    written = sa.func.coalesce(
        operations.c.result["snapshot_id"].astext, operations.c.result["sampling_session_id"].astext
    )
    return conn.execute(
        sa.select(operations.c.seq_id)
        .where(
            operations.c.session_id == session_id,
            operations.c.sampler_id.is_(None),
            operations.c.type == OpType.SAVE_WEIGHTS_FOR_SAMPLER,
            operations.c.status == OpStatus.COMPLETED,
            written == snapshot_id,
        )
        .order_by(operations.c.seq_id.desc())
        .limit(1)
    ).scalar_one_or_none()


def settle(
    conn: sa.Connection,
    op: OperationRow,
    *,
    worker_id: str,
    lease_epoch: int,
    result: Mapping[str, Any] | None,
    error: Mapping[str, Any] | None,
    usage: Mapping[str, Any],
    state: Mapping[str, str] | None = None,
    also: Callable[[sa.Connection], Mapping[str, Any] | None] | None = None,
    metering: bool = True,
) -> Settlement:
    """Record an operation's outcome; `Settlement.is_new` is False when it had already been
    settled (a duplicate). With `metering`, a completed operation gets its one usage row (its
    `charge`), and any operation's reservation is released.

    Raises StaleLeaseError when this worker no longer holds the session's lease at `lease_epoch`.
    `state` holds the adapter's state hashes after a state-changing operation. `also` runs inside
    the same transaction when the operation succeeded (e.g. registering the checkpoint it saved);
    the fields it returns are added to the result (the registry version of a save), in the
    operation's row and its event alike.
    """
    row = conn.execute(
        _OUTCOME,
        {
            "outcome_session_id": op.session_id,
            "outcome_worker_id": worker_id,
            "outcome_lease_epoch": lease_epoch,
            "outcome_request_id": op.request_id,
            "outcome_seq_id": op.seq_id,
            "outcome_status": OpStatus.COMPLETED if error is None else OpStatus.FAILED,
            "outcome_result": result,
            "outcome_error": error,
            "outcome_state": None if error is not None or state is None else dict(state),
        },
    ).first()
    if row is None:
        raise NotFoundError(f"model {op.session_id} not found")
    session = sessions_core.session_row(row)
    check_holder(session, worker_id, lease_epoch)
    if row.outcome_claimed is None:
        return Settlement(is_new=False)
    applied: dict[str, Any] | None = None
    if op.sampler_id is None:
        # Only seq_ids refused at admission may lie between the last applied one and this.
        expected = session.last_applied_seq + 1
        if op.seq_id != expected:
            if refused_run(conn, op.session_id, expected) != op.seq_id - 1:
                raise StaleLeaseError(
                    f"{op.session_id}: seq {op.seq_id} settled out of order "
                    f"(last applied {session.last_applied_seq})"
                )
            conn.execute(
                sa.delete(refused_seqs).where(
                    refused_seqs.c.session_id == op.session_id, refused_seqs.c.seq_id < op.seq_id
                )
            )
        applied = {**_APPLIED, "applied_seq": op.seq_id}
    data = {"request_id": op.request_id, "seq_id": op.seq_id, "type": op.type, **usage}
    charge = None
    if error is None:
        added = also(conn) if also is not None else None
        if added:
            result = {**(result or {}), **added}
            conn.execute(
                sa.update(operations)
                .where(operations.c.request_id == op.request_id)
                .values(result=result)
            )
        completed = {**data, "result": result}
        if state is not None:
            completed["state"] = dict(state)
        _append_outcome(conn, op, "OperationCompleted", completed, applied)
        if metering and not session.is_replay:  # a replay is never billed
            charge = metering_core.charge(
                conn,
                price=prices.from_json(row.outcome_prices),
                request_id=op.request_id,
                session=session,
                sampler_id=op.sampler_id,
                actor=op.actor,
                op_type=op.type,
                tokens=usage.get("tokens", {}),
            )
    else:
        _append_outcome(conn, op, "OperationFailed", {**data, "error": error}, applied)
        if metering:
            metering_core.release(conn, [op.request_id])
    return Settlement(
        is_new=True, charge=charge, next_pending=row.outcome_next_pending, result=result
    )


def _append_outcome(
    conn: sa.Connection,
    op: OperationRow,
    type: str,
    data: Mapping[str, Any],
    applied: Mapping[str, Any] | None,
) -> None:
    """The outcome's event; a training operation's (`applied`) also advances the session's last
    applied seq_id, in the same statement."""
    if applied is None:
        events.append(conn, op.session_id, op.tenant_id, type, data)
    else:
        events.append_then(
            conn, _APPLIED_SQL, op.session_id, op.tenant_id, type, data, params=applied
        )


def _row(row: sa.Row[Any], *, prefix: str = "") -> OperationRow:
    """An operation from a row of the `operations` table's columns (named `prefix` + column)."""

    def col(name: str) -> Any:
        return getattr(row, prefix + name)

    return OperationRow(
        request_id=col("request_id"),
        tenant_id=col("tenant_id"),
        session_id=col("session_id"),
        sampler_id=col("sampler_id"),
        seq_id=col("seq_id"),
        type=OpType(col("type")),
        status=OpStatus(col("status")),
        request_position=col("request_position"),
        result=col("result"),
        error=col("error"),
        state=col("state"),
        actor=col("actor"),
        requested_at=col("created_at"),
    )


def oldest_pending_training_op(conn: sa.Connection, session_id: str) -> tuple[int, float] | None:
    """(seq_id, age in seconds) of the lowest pending training operation, if any."""
    row = conn.execute(_OLDEST_PENDING, {"session_id": session_id}).first()
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
            operations.c.status == OpStatus.PENDING,
            operations.c.created_at
            < sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, min_age),
        )
        .order_by(operations.c.session_id, operations.c.seq_id)
    )
    return [(r.session_id, r.request_id) for r in rows]


def pending_samples(conn: sa.Connection, session_ids: list[str]) -> list[str]:
    """Request ids of the pending sample operations of `session_ids`, in (session, seq) order:
    what a worker looks up between a training operation's passes, so one query, not one per
    pending operation."""
    if not session_ids:
        return []
    rows = conn.execute(
        sa.select(operations.c.request_id)
        .where(
            operations.c.session_id.in_(session_ids),
            operations.c.status == OpStatus.PENDING,
            operations.c.type == OpType.SAMPLE,
            operations.c.sampler_id.is_not(None),
        )
        .order_by(operations.c.session_id, operations.c.seq_id)
    )
    return [r.request_id for r in rows]


# --- holes in the seq_id sequence ---------------------------------------------------------


def record_refusal(conn: sa.Connection, principal: Principal, session_id: str, seq_id: int) -> bool:
    """Remember that the request for a training `seq_id` was refused at admission, so the
    session's next operations do not wait for it. Nothing is logged: a refused request appends
    no event. Ignored for another tenant's session, a used seq_id or one already applied."""
    used = sa.exists().where(
        operations.c.session_id == session_id,
        operations.c.sampler_id.is_(None),
        operations.c.seq_id == seq_id,
    )
    source = sa.select(sessions.c.id, sa.literal(seq_id, sa.BigInteger)).where(
        sessions.c.id == session_id,
        sessions.c.tenant_id == principal.tenant_id,
        sessions.c.last_applied_seq < seq_id,
        ~used,
    )
    stmt = sa.dialects.postgresql.insert(refused_seqs).from_select(["session_id", "seq_id"], source)
    inserted = conn.execute(stmt.on_conflict_do_nothing().returning(refused_seqs.c.seq_id))
    return inserted.first() is not None


def refused_run(conn: sa.Connection, session_id: str, from_seq: int) -> int:
    """The last seq_id of the unbroken run of refused seq_ids starting at `from_seq`
    (from_seq - 1 when `from_seq` itself was not refused)."""
    seqs = conn.execute(
        sa.select(refused_seqs.c.seq_id)
        .where(refused_seqs.c.session_id == session_id, refused_seqs.c.seq_id >= from_seq)
        .order_by(refused_seqs.c.seq_id)
        .limit(10_000)
    ).scalars()
    last = from_seq - 1
    for seq in seqs:
        if seq != last + 1:
            break
        last = seq
    return last


def skip_gap(
    conn: sa.Connection,
    session_id: str,
    worker_id: str,
    lease_epoch: int,
    to_seq: int,
    reason: str,
) -> bool:
    """Move the session past seq_ids it never received (and that were not refused: the next
    operation runs over those without this), up to `to_seq` - 1, appending OperationsSkipped. Never skips a seq_id that has a
    request: admission and this both hold the session row's lock. Returns whether it moved.
    Raises StaleLeaseError unless the worker holds the session at `lease_epoch`."""
    session = hold(conn, session_id, worker_id, lease_epoch)
    first = session.last_applied_seq + 1
    lowest_used = conn.execute(
        sa.select(sa.func.min(operations.c.seq_id)).where(
            operations.c.session_id == session_id,
            operations.c.sampler_id.is_(None),
            operations.c.seq_id >= first,
        )
    ).scalar_one_or_none()
    if lowest_used is not None:
        to_seq = min(to_seq, lowest_used)
    if to_seq <= first:
        return False
    conn.execute(
        sa.update(sessions).where(sessions.c.id == session_id).values(last_applied_seq=to_seq - 1)
    )
    conn.execute(
        sa.delete(refused_seqs).where(
            refused_seqs.c.session_id == session_id, refused_seqs.c.seq_id < to_seq
        )
    )
    events.append(
        conn,
        session_id,
        session.tenant_id,
        "OperationsSkipped",
        {"from_seq": first, "to_seq": to_seq - 1, "reason": reason},
    )
    return True
