"""Sessions: client sessions, training/sampling sessions, samplers, and worker leases.

A training session is a Tinker model (`<client session>:train:<n>`): a base model plus a LoRA
adapter, one event stream, leased to one worker at a time (worker id + epoch). Every lookup is
scoped by tenant, and another tenant's id answers exactly like a missing one.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import sqlalchemy as sa

from treadle.platform.errors import GoneError, NotFoundError, ValidationError
from treadle.platform.eventlog import events
from treadle.platform.eventlog.schema import client_sessions, samplers, sessions
from treadle.platform.tenancy.tenants import Principal


class SessionStatus(StrEnum):
    CREATED = "Created"
    RUNNING = "Running"
    STOPPED = "Stopped"
    # Replay did not reproduce the recorded state: the session stopped rather than go on
    # training weights that differ from what its log says.
    DIVERGED = "Diverged"
    # The session cannot be rebuilt (a file its recovery needs is gone): it stopped.
    FAILED = "Failed"
    # Its client stopped heartbeating for the idle time: it stopped and freed what it held.
    EXPIRED = "Expired"


ACTIVE_STATUSES = (SessionStatus.CREATED, SessionStatus.RUNNING)


class SessionKind(StrEnum):
    TRAINING = "training"  # base model + LoRA adapter (a fork is one too, with a source)
    SAMPLING = "sampling"  # a base-model sampler with no adapter
    REPLAY = "replay"  # a read-only, never billed rebuild of another session's log


# The kinds whose worker holds an adapter built from the session's log.
ADAPTER_KINDS = (SessionKind.TRAINING, SessionKind.REPLAY)


class ClientSessionStatus(StrEnum):
    """A client session (one SDK ServiceClient): running until its client finishes it."""

    RUNNING = "Running"
    FINISHED = "Finished"
    EXPIRED = "Expired"  # its client stopped heartbeating


@dataclass(frozen=True)
class SessionRow:
    id: str
    tenant_id: str
    client_session_id: str
    kind: str
    name: str | None
    base_model: str
    lora_config: Mapping[str, Any]
    status: str
    worker_id: str | None
    lease_epoch: int
    last_applied_seq: int
    model_package_group: str | None = None
    user_metadata: Mapping[str, Any] | None = None
    updated_at: Any = None
    max_cost_micro_usd: int | None = None  # the session's spend cap (max_cost_usd)
    spent_micro_usd: int = 0
    reserved_micro_usd: int = 0  # held by its admitted, unsettled operations
    source_session_id: str | None = None  # a replay or fork: built from this session's log
    source_seq: int | None = None  # ... as it stood right after this seq_id

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    @property
    def is_replay(self) -> bool:
        return self.kind == SessionKind.REPLAY


def training_session_id(client_session_id: str, model_seq_id: int) -> str:
    """The Tinker SDK derives model ids itself in this exact format (create-via-load)."""
    return f"{client_session_id}:train:{model_seq_id}"


def sampler_id(client_session_id: str, sampling_session_seq_id: int) -> str:
    return f"{client_session_id}:sample:{sampling_session_seq_id}"


def create_client_session(
    conn: sa.Connection,
    principal: Principal,
    tags: list[str],
    user_metadata: Mapping[str, Any],
    display_name: str | None = None,
) -> str:
    session_id = "sess-" + secrets.token_hex(8)
    conn.execute(
        client_sessions.insert().values(
            id=session_id,
            tenant_id=principal.tenant_id,
            tags=list(tags),
            user_metadata=dict(user_metadata),
            status=ClientSessionStatus.RUNNING,
            created_by=principal.key_id,
            display_name=display_name,
        )
    )
    return session_id


def get_client_session(conn: sa.Connection, principal: Principal, session_id: str) -> str:
    row = conn.execute(
        sa.select(client_sessions.c.id, client_sessions.c.status).where(
            client_sessions.c.id == session_id,
            client_sessions.c.tenant_id == principal.tenant_id,
        )
    ).first()
    if row is None:
        raise NotFoundError(f"session {session_id} not found; create one with create_session")
    return str(row.status)


def require_running_client_session(
    conn: sa.Connection, principal: Principal, session_id: str
) -> None:
    """The caller's client session, which must still be running to open anything in it:
    NotFoundError, or GoneError (410) for a finished or expired one."""
    status = get_client_session(conn, principal, session_id)
    if status == ClientSessionStatus.EXPIRED:
        raise GoneError(
            f"session {session_id} expired: its client sent no heartbeat for too long, and what "
            "it opened was stopped; create a new ServiceClient (and resume from a checkpoint)"
        )
    if status != ClientSessionStatus.RUNNING:
        raise GoneError(
            f"session {session_id} is {status}; create a new ServiceClient to open models"
        )


def heartbeat_client_session(conn: sa.Connection, principal: Principal, session_id: str) -> str:
    status = conn.execute(
        sa.update(client_sessions)
        .where(
            client_sessions.c.id == session_id,
            client_sessions.c.tenant_id == principal.tenant_id,
        )
        .values(heartbeat_at=sa.func.now())
        .returning(client_sessions.c.status)
    ).scalar_one_or_none()
    if status is None:
        raise NotFoundError(f"session {session_id} not found")
    return str(status)


def create_session(
    conn: sa.Connection,
    principal: Principal,
    *,
    session_id: str,
    client_session_id: str,
    kind: str,
    base_model: str,
    name: str | None = None,
    lora_config: Mapping[str, Any] | None = None,
    user_metadata: Mapping[str, Any] | None = None,
    model_package_group: str | None = None,
    max_cost_micro_usd: int | None = None,
    source_session_id: str | None = None,
    source_seq: int | None = None,
) -> bool:
    """Create a session row and its SessionCreated event. Returns False if it already existed."""
    stmt = sa.dialects.postgresql.insert(sessions).values(
        id=session_id,
        tenant_id=principal.tenant_id,
        client_session_id=client_session_id,
        kind=kind,
        name=name,
        base_model=base_model,
        max_cost_micro_usd=max_cost_micro_usd,
        lora_config=dict(lora_config or {}),
        user_metadata=dict(user_metadata or {}),
        model_package_group=model_package_group,
        status=SessionStatus.CREATED,
        source_session_id=source_session_id,
        source_seq=source_seq,
    )
    inserted = conn.execute(
        stmt.on_conflict_do_nothing(index_elements=["id"]).returning(sessions.c.id)
    ).first()
    if inserted is None:
        get_session(conn, principal, session_id)  # 404 if it is another tenant's
        return False
    events.append(
        conn,
        session_id,
        principal.tenant_id,
        "SessionCreated",
        {
            "kind": kind,
            "base_model": base_model,
            "name": name,
            "lora_config": dict(lora_config or {}),
            "client_session_id": client_session_id,
            "max_cost_micro_usd": max_cost_micro_usd,
            "source_session_id": source_session_id,
            "source_seq": source_seq,
        },
        actor=principal.key_id,
    )
    return True


# Built once: these run several times in every operation (admission, the worker's reads, its
# settlement), and building a statement took more CPU than PostgreSQL takes to run it.
_BY_ID = sa.select(sessions).where(sessions.c.id == sa.bindparam("session_id"))
_BY_ID_OF_TENANT = _BY_ID.where(sessions.c.tenant_id == sa.bindparam("tenant_id"))
_GET_SESSION = {  # (scoped to a tenant, for update)
    (False, False): _BY_ID,
    (True, False): _BY_ID_OF_TENANT,
    (False, True): _BY_ID.with_for_update(),
    (True, True): _BY_ID_OF_TENANT.with_for_update(),
}


def get_session(
    conn: sa.Connection, principal: Principal | None, session_id: str, *, for_update: bool = False
) -> SessionRow:
    """Look a session up; `principal=None` is the platform itself (workers), unscoped."""
    params = {"session_id": session_id}
    if principal is not None:
        params["tenant_id"] = principal.tenant_id
    row = conn.execute(_GET_SESSION[principal is not None, for_update], params).first()
    if row is None:
        raise NotFoundError(f"model {session_id} not found")
    return session_row(row)


def session_row(row: sa.Row[Any]) -> SessionRow:
    """A session from a row holding the `sessions` table's columns (among others)."""
    return SessionRow(
        id=row.id,
        tenant_id=row.tenant_id,
        client_session_id=row.client_session_id,
        kind=row.kind,
        name=row.name,
        base_model=row.base_model,
        lora_config=row.lora_config,
        status=row.status,
        worker_id=row.worker_id,
        lease_epoch=row.lease_epoch,
        last_applied_seq=row.last_applied_seq,
        model_package_group=row.model_package_group,
        user_metadata=row.user_metadata,
        updated_at=row.updated_at,
        max_cost_micro_usd=row.max_cost_micro_usd,
        spent_micro_usd=row.spent_micro_usd,
        reserved_micro_usd=row.reserved_micro_usd,
        source_session_id=row.source_session_id,
        source_seq=row.source_seq,
    )


def list_sessions(
    conn: sa.Connection, principal: Principal, *, kind: str, limit: int, offset: int
) -> tuple[list[SessionRow], int]:
    """One page of the tenant's sessions of `kind`, oldest first, and how many there are."""
    scope = (sessions.c.tenant_id == principal.tenant_id, sessions.c.kind == kind)
    total = conn.execute(sa.select(sa.func.count()).where(*scope)).scalar_one()
    rows = conn.execute(
        sa.select(sessions)
        .where(*scope)
        .order_by(sessions.c.created_at, sessions.c.id)
        .limit(limit)
        .offset(offset)
    )
    return [session_row(r) for r in rows], int(total)


def create_sampler(
    conn: sa.Connection,
    principal: Principal,
    *,
    sampler: str,
    client_session_id: str,
    session_id: str,
    base_model: str,
    snapshot_id: str | None,
    model_path: str | None = None,
    checkpoint_prefix: str | None = None,
) -> None:
    stmt = sa.dialects.postgresql.insert(samplers).values(
        id=sampler,
        tenant_id=principal.tenant_id,
        client_session_id=client_session_id,
        session_id=session_id,
        base_model=base_model,
        snapshot_id=snapshot_id,
        model_path=model_path,
        checkpoint_prefix=checkpoint_prefix,
    )
    conn.execute(stmt.on_conflict_do_nothing(index_elements=["id"]))


_NEXT_SAMPLER_SEQ = (
    sa.update(samplers)
    .where(samplers.c.id == sa.bindparam("sampler"))
    .values(next_seq_id=samplers.c.next_seq_id + 1)
    .returning(samplers.c.next_seq_id)
)


def next_sampler_seq(conn: sa.Connection, sampler: str) -> int:
    """A seq_id of `sampler` no other request has (for samplers whose seq_ids the server
    allocates: the OpenAI routes', SageMaker's runtime's): one atomic increment of its row."""
    return int(conn.execute(_NEXT_SAMPLER_SEQ, {"sampler": sampler}).scalar_one()) - 1


@dataclass(frozen=True)
class SamplerRow:
    id: str
    session_id: str
    base_model: str
    snapshot_id: str | None
    model_path: str | None
    checkpoint_prefix: str | None


def get_sampler(conn: sa.Connection, principal: Principal | None, sampler: str) -> SamplerRow:
    query = sa.select(samplers).where(samplers.c.id == sampler)
    if principal is not None:
        query = query.where(samplers.c.tenant_id == principal.tenant_id)
    row = conn.execute(query).first()
    if row is None:
        raise NotFoundError(
            f"sampler {sampler} not found; create one with create_sampling_session or "
            "save_weights_for_sampler"
        )
    return SamplerRow(
        row.id,
        row.session_id,
        row.base_model,
        row.snapshot_id,
        row.model_path,
        row.checkpoint_prefix,
    )


def stop_session(conn: sa.Connection, principal: Principal, session_id: str, reason: str) -> bool:
    """Mark a session Stopped (appends SessionStopped). Returns False if it was already stopped."""
    session = get_session(conn, principal, session_id, for_update=True)
    if not session.is_active:
        return False
    conn.execute(
        sa.update(sessions).where(sessions.c.id == session_id).values(status=SessionStatus.STOPPED)
    )
    events.append(
        conn,
        session_id,
        principal.tenant_id,
        "SessionStopped",
        {"reason": reason},
        actor=principal.key_id,
    )
    return True


def halt_session(
    conn: sa.Connection, session: SessionRow, status: SessionStatus, data: Mapping[str, Any]
) -> None:
    """End a session that can no longer be trusted (DIVERGED) or rebuilt (FAILED), appending
    SessionDiverged or SessionFailed with `data`. The caller holds the session's lease."""
    assert status in (SessionStatus.DIVERGED, SessionStatus.FAILED), status
    conn.execute(sa.update(sessions).where(sessions.c.id == session.id).values(status=status))
    event = "SessionDiverged" if status == SessionStatus.DIVERGED else "SessionFailed"
    events.append(conn, session.id, session.tenant_id, event, dict(data))


def expire_idle(conn: sa.Connection, idle_seconds: float, limit: int = 50) -> list[str]:
    """Expire the client sessions that have not heartbeated for `idle_seconds`, and their live
    sessions (appends SessionExpired to each). Returns the expired sessions' ids; the caller
    fails their pending operations (releasing what they hold)."""
    idle = (
        conn.execute(
            sa.select(client_sessions.c.id)
            .where(
                client_sessions.c.status == ClientSessionStatus.RUNNING,
                client_sessions.c.heartbeat_at
                < sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, idle_seconds),
            )
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        .scalars()
        .all()
    )
    if not idle:
        return []
    conn.execute(
        sa.update(client_sessions)
        .where(client_sessions.c.id.in_(idle))
        .values(status=ClientSessionStatus.EXPIRED)
    )
    expired = conn.execute(
        sa.update(sessions)
        .where(sessions.c.client_session_id.in_(idle), sessions.c.status.in_(ACTIVE_STATUSES))
        .values(status=SessionStatus.EXPIRED)
        .returning(sessions.c.id, sessions.c.tenant_id, sessions.c.client_session_id)
    ).all()
    for row in expired:
        events.append(
            conn,
            row.id,
            row.tenant_id,
            "SessionExpired",
            {
                "client_session_id": row.client_session_id,
                "idle_seconds": idle_seconds,
                "reason": f"its client sent no heartbeat for {idle_seconds:g} s",
            },
        )
    return [row.id for row in expired]


def expired_message(session_id: str, idle_seconds: float | None = None) -> str:
    idle = "" if idle_seconds is None else f" after {idle_seconds:g} s"
    return (
        f"model {session_id} expired{idle} without a heartbeat from its client (the process "
        "that created it stopped); its adapter was freed. Resume from its last checkpoint: "
        "ServiceClient.create_training_client_from_state_with_optimizer(path)"
    )


def finish_client_session(
    conn: sa.Connection, principal: Principal, client_session_id: str, reason: str
) -> list[str]:
    """Finish a client session and stop every session it opened; returns the stopped ids."""
    get_client_session(conn, principal, client_session_id)
    conn.execute(
        sa.update(client_sessions)
        .where(client_sessions.c.id == client_session_id)
        .values(status=ClientSessionStatus.FINISHED)
    )
    ids = conn.execute(
        sa.select(sessions.c.id).where(
            sessions.c.client_session_id == client_session_id,
            sessions.c.status.in_(ACTIVE_STATUSES),
        )
    ).scalars()
    return [i for i in list(ids) if stop_session(conn, principal, i, reason)]


def ensure_valid_name(name: str | None) -> str | None:
    if name is None:
        return None
    if not (1 <= len(name) <= 128) or any(c in name for c in "/\x00") or name in (".", ".."):
        raise ValidationError(
            "training_session_name must be 1-128 characters with no '/' or NUL, and not '.' or '..'"
        )
    return name
