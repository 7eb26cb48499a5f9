"""SageMaker training sessions: a name for one of Treadle's training sessions, its lifecycle as
SageMaker's status enum says it, and what Describe reports.

A SageMaker session is an ordinary training session (its own client session, tagged
SAGEMAKER_TAG, its first operation `create_model` at seq 0), so it is leased, ordered, recovered,
metered, audited and replayed like any other; `sagemaker_sessions` adds its name (unique among
the tenant's undeleted ones: the runtime addresses it by name) and the attributes Describe
echoes. Statuses: Created (no worker yet) -> Scheduled (placed, its adapter being made) ->
Running, Blocked while a later sequence number waits for a missing one (until it arrives or the
worker's gap timeout passes it over), Stopped, Failed (diverged from its log or unrecoverable),
Expired (no request for the idle time). A stop takes effect at once (no Stopping is ever seen);
a delete removes the name at once (no Deleting); both are events in the session's log.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from treadle.platform.errors import AlreadyExistsError, NotFoundError, ValidationError
from treadle.platform.eventlog import events, optypes
from treadle.platform.eventlog.schema import (
    client_sessions,
    operations,
    refused_seqs,
    sagemaker_sessions,
    sessions,
    usage,
)
from treadle.platform.eventlog.schema import events as event_rows
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.operations import commands
from treadle.platform.sagemaker import packages
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.sessions.sessions import SessionRow, SessionStatus
from treadle.platform.tenancy.tenants import Principal

SAGEMAKER_TAG = "treadle:sagemaker"


class Status(StrEnum):
    CREATED = "Created"
    SCHEDULED = "Scheduled"
    RUNNING = "Running"
    BLOCKED = "Blocked"
    FAILED = "Failed"
    STOPPING = "Stopping"
    STOPPED = "Stopped"
    EXPIRED = "Expired"
    DELETING = "Deleting"
    DELETION_FAILED = "DeletionFailed"


# The statuses a stop or a delete may start from.
STOPPABLE = (Status.CREATED, Status.SCHEDULED, Status.RUNNING, Status.BLOCKED)
DELETABLE = (Status.STOPPED, Status.FAILED, Status.EXPIRED)


@dataclass(frozen=True)
class TrainingSession:
    name: str
    session: SessionRow
    attributes: Mapping[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class Detail:
    """What Describe says beyond the session itself."""

    status: Status
    error: str | None
    last_received_seq: int | None
    tokens: Mapping[str, int]  # prefill, sample, train: what the session was billed for
    updated_at: datetime | None
    ended_at: datetime | None


def create(
    deps: commands.Deps,
    principal: Principal,
    *,
    name: str,
    model: BaseModelInfo,
    rank: int,
    alpha: int,
    group: str,
    attributes: Mapping[str, Any],
) -> TrainingSession:
    """Open a training session called `name` on `model` with a fresh LoRA adapter whose saves
    become versions of `group`. AlreadyExistsError while the tenant has an undeleted session of
    that name; the platform's own refusals (no live worker, the session quota) as they are."""
    model.check_lora(rank, True, True, True)
    with deps.db.begin() as conn:
        if _live_row(conn, principal, name) is not None:
            raise _taken(name)
        client_session_id = sessions_core.create_client_session(
            conn, principal, [SAGEMAKER_TAG], {}, display_name=name
        )
    session_id = sessions_core.training_session_id(client_session_id, 0)
    lora = optypes.LoraConfig(rank=rank, alpha=float(alpha))

    def with_session(conn: sa.Connection) -> None:
        packages.ensure_group(conn, principal, group)
        conn.execute(
            sagemaker_sessions.insert().values(
                session_id=session_id,
                tenant_id=principal.tenant_id,
                name=name,
                attributes=dict(attributes),
            )
        )

    try:
        commands.open_session(
            deps,
            principal,
            session_id=session_id,
            client_session_id=client_session_id,
            kind=sessions_core.SessionKind.TRAINING,
            base_model=model.name,
            first=optypes.CreateModel(base_model=model.name, lora_config=lora),
            with_session=with_session,
            name=name,
            lora_config=lora.model_dump(),
            model_package_group=group,
        )
    except IntegrityError:  # a concurrent create took the name
        raise _taken(name) from None
    finally:
        with deps.db.begin() as conn:  # nothing else ever opens anything in it
            _finish_unused(conn, client_session_id)
    with deps.db.connect() as conn:
        return get(conn, principal, name)


def _taken(name: str) -> AlreadyExistsError:
    return AlreadyExistsError(
        f"a training session named {name} already exists; choose another name, or delete that "
        "one first (it must be stopped)"
    )


def _finish_unused(conn: sa.Connection, client_session_id: str) -> None:
    """A client session whose training session was never created is finished at once."""
    conn.execute(
        sa.update(client_sessions)
        .where(
            client_sessions.c.id == client_session_id,
            ~sa.exists().where(sessions.c.client_session_id == client_session_id),
        )
        .values(status=sessions_core.ClientSessionStatus.FINISHED)
    )


# A named session's row: the session's columns, then its name, attributes and naming time.
_NAMED = sa.select(
    sessions,
    sagemaker_sessions.c.name.label("sagemaker_name"),
    sagemaker_sessions.c.attributes,
    sagemaker_sessions.c.created_at.label("named_at"),
).join(sessions, sessions.c.id == sagemaker_sessions.c.session_id)


def _live_row(conn: sa.Connection, principal: Principal, name: str) -> Any:
    return conn.execute(
        _NAMED.where(
            sagemaker_sessions.c.tenant_id == principal.tenant_id,
            sagemaker_sessions.c.name == name,
            sagemaker_sessions.c.deleted_at.is_(None),
        )
    ).first()


def get(conn: sa.Connection, principal: Principal, name: str) -> TrainingSession:
    """The caller's undeleted session called `name`; NotFoundError (another tenant's answers
    the same) otherwise."""
    row = _live_row(conn, principal, name)
    if row is None:
        raise NotFoundError(f"training session {name} not found")
    return _session(row)


def _session(row: Any) -> TrainingSession:
    return TrainingSession(
        name=row.sagemaker_name,
        session=sessions_core.session_row(row),
        attributes=row.attributes,
        created_at=row.named_at,
    )


def touch(conn: sa.Connection, session: SessionRow) -> None:
    """A runtime request keeps its session from expiring as idle: SageMaker's clients send no
    heartbeat of their own."""
    conn.execute(
        sa.update(client_sessions)
        .where(client_sessions.c.id == session.client_session_id)
        .values(heartbeat_at=sa.func.now())
    )


def status_of(session: SessionRow, *, blocked: bool = False) -> Status:
    """SageMaker's status of a session (`blocked`: a later sequence number waits on a gap)."""
    if session.status == SessionStatus.CREATED:
        return Status.SCHEDULED if session.worker_id else Status.CREATED
    if session.status == SessionStatus.RUNNING:
        return Status.BLOCKED if blocked else Status.RUNNING
    if session.status in (SessionStatus.DIVERGED, SessionStatus.FAILED):
        return Status.FAILED
    if session.status == SessionStatus.EXPIRED:
        return Status.EXPIRED
    return Status.STOPPED


def is_blocked(conn: sa.Connection, session: SessionRow) -> bool:
    """Whether a training operation waits for a sequence number that never arrived."""
    expected = session.last_applied_seq + 1
    lowest = conn.execute(
        sa.select(sa.func.min(operations.c.seq_id)).where(
            operations.c.session_id == session.id,
            operations.c.sampler_id.is_(None),
            operations.c.status == optypes.OpStatus.PENDING,
        )
    ).scalar_one_or_none()
    if lowest is None or lowest <= expected:
        return False
    refused = conn.execute(
        sa.select(refused_seqs.c.seq_id).where(
            refused_seqs.c.session_id == session.id, refused_seqs.c.seq_id == expected
        )
    ).first()
    return refused is None


def detail(conn: sa.Connection, found: TrainingSession) -> Detail:
    """Describe's view of a session: its status, why it failed, the last sequence number it
    received and the tokens it was billed for."""
    session = found.session
    status = status_of(session, blocked=session.is_active and is_blocked(conn, session))
    failed_to_start = _failed_to_start(conn, session)
    if failed_to_start is not None:
        status = Status.FAILED
    seqs = [
        conn.execute(
            sa.select(sa.func.max(operations.c.seq_id)).where(
                operations.c.session_id == session.id, operations.c.sampler_id.is_(None)
            )
        ).scalar_one_or_none(),
        conn.execute(
            sa.select(sa.func.max(refused_seqs.c.seq_id)).where(
                refused_seqs.c.session_id == session.id
            )
        ).scalar_one_or_none(),
    ]
    last = max((s for s in seqs if s is not None), default=0)
    billed = conn.execute(
        sa.select(
            sa.func.coalesce(sa.func.sum(usage.c.prefill_tokens), 0),
            sa.func.coalesce(sa.func.sum(usage.c.sample_tokens), 0),
            sa.func.coalesce(sa.func.sum(usage.c.train_tokens), 0),
        ).where(usage.c.session_id == session.id)
    ).one()
    ended = _ending(conn, session) if not session.is_active else None
    return Detail(
        status=status,
        error=failed_to_start or (_error(ended) if status == Status.FAILED else None),
        last_received_seq=last or None,
        tokens={"prefill": int(billed[0]), "sample": int(billed[1]), "train": int(billed[2])},
        updated_at=session.updated_at,
        ended_at=None if ended is None else ended.created_at,
    )


def _failed_to_start(conn: sa.Connection, session: SessionRow) -> str | None:
    """Why a live session's adapter could not be made (its `create_model` failed), if it could
    not: it is Failed, though nothing stopped it yet."""
    if not session.is_active or session.last_applied_seq > 0:
        return None
    first = conn.execute(
        sa.select(operations.c.status, operations.c.error).where(
            operations.c.session_id == session.id,
            operations.c.sampler_id.is_(None),
            operations.c.seq_id == 0,
        )
    ).first()
    if first is None or first.status != optypes.OpStatus.FAILED:
        return None
    return str((first.error or {}).get("message", "the session's adapter was not made"))[:1024]


_ENDINGS = ("SessionStopped", "SessionDiverged", "SessionFailed", "SessionExpired")


def _ending(conn: sa.Connection, session: SessionRow) -> Any:
    """The event that ended the session (None if there is none, e.g. a halt in progress)."""
    return conn.execute(
        sa.select(event_rows.c.type, event_rows.c.data, event_rows.c.created_at)
        .where(event_rows.c.session_id == session.id, event_rows.c.type.in_(_ENDINGS))
        .order_by(event_rows.c.position.desc())
        .limit(1)
    ).first()


def _error(ended: Any) -> str:
    if ended is None:
        return "the session failed"
    message = str(ended.data.get("message") or ended.data.get("reason") or ended.type)
    return message[:1024]


def list_page(
    conn: sa.Connection,
    principal: Principal,
    *,
    name_contains: str | None,
    status: Status | None,
    created_after: datetime | None,
    created_before: datetime | None,
    offset: int,
    limit: int,
) -> tuple[list[tuple[TrainingSession, Status]], bool]:
    """One page of the caller's undeleted sessions, newest first, with their statuses, and
    whether more follow."""
    query = _NAMED.where(
        sagemaker_sessions.c.tenant_id == principal.tenant_id,
        sagemaker_sessions.c.deleted_at.is_(None),
    ).order_by(sagemaker_sessions.c.created_at.desc(), sagemaker_sessions.c.session_id)
    if name_contains:
        query = query.where(sagemaker_sessions.c.name.contains(name_contains, autoescape=True))
    if created_after is not None:
        query = query.where(sagemaker_sessions.c.created_at > created_after)
    if created_before is not None:
        query = query.where(sagemaker_sessions.c.created_at < created_before)
    found: list[tuple[TrainingSession, Status]] = []
    for row in conn.execute(query):
        item = _session(row)
        session = item.session
        item_status = status_of(session, blocked=session.is_active and is_blocked(conn, session))
        if status is None or item_status == status:
            found.append((item, item_status))
    return found[offset : offset + limit], len(found) > offset + limit


def stop(deps: commands.Deps, principal: Principal, name: str) -> None:
    """Stop a session. A session that is not live refuses with SageMaker's wording for a stop
    that has nothing to do (`invalid session state transition from <status> to Stopping`),
    which the SDK takes as done."""
    with deps.db.connect() as conn:
        found = get(conn, principal, name)
    current = status_of(found.session)
    if current not in STOPPABLE:
        raise ValidationError(f"invalid session state transition from {current} to Stopping")
    commands.stop_session(deps, principal, found.session.id)


def delete(conn: sa.Connection, principal: Principal, name: str) -> None:
    """Delete a stopped, failed or expired session: its name is free again, and it is gone from
    Describe and List (its log, checkpoints and bills stay)."""
    found = get(conn, principal, name)
    locked = sessions_core.get_session(conn, principal, found.session.id, for_update=True)
    current = status_of(locked)
    if current not in DELETABLE:
        raise ValidationError(
            f"invalid session state transition from {current} to Deleting; stop the session "
            "first (StopTrainingSession)"
        )
    conn.execute(
        sa.update(sagemaker_sessions)
        .where(sagemaker_sessions.c.session_id == locked.id)
        .values(deleted_at=sa.func.now())
    )
    events.append(
        conn,
        locked.id,
        principal.tenant_id,
        "SessionDeleted",
        {"name": name},
        actor=principal.key_id,
    )
