"""Futures beyond one result: cancelling a pending request, the completions of a sampling
session's requests in order (`retrieve_futures`) and the clone numbers of its clients
(`join_sampling_session`), tenant-scoped like every lookup.

A sampling client's seq_ids live in blocks of CLONE_BLOCK: the original client's start at 0, a
clone's at CLONE_BLOCK x its number. The completions cursor is the position of the event that
settled a request (`OperationCompleted` / `OperationFailed`), so it only moves forward and a
request settles exactly once under it. Owns `samplers.clients_joined`.
Imports nothing from api, engine, worker, Flask or torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import sqlalchemy as sa

from treadle.platform.errors import NotFoundError, ValidationError
from treadle.platform.eventlog import notify
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.eventlog.schema import events, samplers
from treadle.platform.eventlog.schema import operations as operation_rows
from treadle.platform.operations import cancellation, commands, operations
from treadle.platform.sessions import routing
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.tenancy.tenants import Principal

log = logging.getLogger(__name__)

CLONE_BLOCK = 1_000_000_000
MAX_COMPLETIONS = 1000  # one answer's; the cursor picks up the rest


@dataclass(frozen=True)
class Completion:
    request_id: str
    is_finished: bool  # False: failed (its error comes with retrieve_future)
    position: int  # the cursor after it


def cancel(deps: commands.Deps, principal: Principal, request_id: str) -> operations.OperationRow:
    """Cancel the caller's pending request (`cancellation.cancel`), then wake whoever waits on it
    and the session's worker, so the operation after a cancelled training seq_id runs at once."""
    with deps.db.begin() as conn:
        op = cancellation.cancel(conn, principal, request_id)
    notify.publish_done(deps.redis, request_id)
    try:
        routing.wake(deps.celery, op.session_id, None)
    except Exception as exc:  # the log is the truth; the lease keeper re-wakes stalled sessions
        log.warning("could not wake %s after cancelling %s: %s", op.session_id, request_id, exc)
    return op


def completions(
    conn: sa.Connection,
    principal: Principal,
    sampler_id: str,
    clone: int,
    *,
    after: int,
    limit: int = MAX_COMPLETIONS,
) -> list[Completion]:
    """The settled requests of one client (`clone`) of the caller's sampler whose settlement
    came after cursor `after`, oldest first."""
    sampler = sessions_core.get_sampler(conn, principal, sampler_id)
    request_id = events.c.data["request_id"].astext
    rows = conn.execute(
        sa.select(events.c.position, operation_rows.c.request_id, operation_rows.c.status)
        .select_from(events.join(operation_rows, operation_rows.c.request_id == request_id))
        .where(
            events.c.session_id == sampler.session_id,
            events.c.type.in_(("OperationCompleted", "OperationFailed")),
            events.c.position > after,
            operation_rows.c.tenant_id == principal.tenant_id,
            operation_rows.c.sampler_id == sampler.id,
            operation_rows.c.seq_id >= clone * CLONE_BLOCK,
            operation_rows.c.seq_id < (clone + 1) * CLONE_BLOCK,
        )
        .order_by(events.c.position)
        .limit(limit)
    )
    return [Completion(r.request_id, r.status == OpStatus.COMPLETED, r.position) for r in rows]


def pending(conn: sa.Connection, principal: Principal, sampler_id: str, clone: int) -> list[str]:
    """The request ids of one client of the caller's sampler that are still pending, oldest
    first."""
    sampler = sessions_core.get_sampler(conn, principal, sampler_id)
    return list(
        conn.execute(
            sa.select(operation_rows.c.request_id)
            .where(
                operation_rows.c.tenant_id == principal.tenant_id,
                operation_rows.c.sampler_id == sampler.id,
                operation_rows.c.status == OpStatus.PENDING,
                operation_rows.c.seq_id >= clone * CLONE_BLOCK,
                operation_rows.c.seq_id < (clone + 1) * CLONE_BLOCK,
            )
            .order_by(operation_rows.c.seq_id)
        ).scalars()
    )


def join(conn: sa.Connection, principal: Principal, sampler_id: str) -> int:
    """The next clone number of the caller's sampler (1, 2, ...; the original client is 0)."""
    number = conn.execute(
        sa.update(samplers)
        .where(samplers.c.id == sampler_id, samplers.c.tenant_id == principal.tenant_id)
        .values(clients_joined=samplers.c.clients_joined + 1)
        .returning(samplers.c.clients_joined)
    ).scalar_one_or_none()
    if number is None:
        raise NotFoundError(
            f"sampling session {sampler_id} not found; create one with create_sampling_session"
        )
    if number >= CLONE_BLOCK:
        raise ValidationError(  # its clones' seq_id blocks would overflow
            f"sampling session {sampler_id} has had {CLONE_BLOCK - 1} clones; create a new one"
        )
    return int(number)
