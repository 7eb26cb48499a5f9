"""Workers and leases: which worker is alive, and which worker hosts which session.

A worker heartbeats its row in `workers`; one silent for the lease TTL is dead. A session is
leased to one worker at a time (worker id + epoch on the session row); every new lease bumps
the epoch (`SessionLeased`), so a write by a previous holder is refused at settlement. A worker
that stops or dies gives its leases back (`SessionReleased`) and live workers claim them.
Every change is counted by reason once its transaction commits (`treadle_lease_changes_total`).
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from treadle.platform import metrics
from treadle.platform.eventlog import events
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.eventlog.schema import operations, sessions, workers
from treadle.platform.sessions import admission
from treadle.platform.sessions.sessions import ACTIVE_STATUSES, SessionRow, get_session

# The advisory lock every read of workers' room takes (`with_room`), held to the end of its
# transaction: one placement at a time (the schema's migrations take 727170, prices 727171).
PLACEMENT_LOCK = 727172


class StaleLeaseError(Exception):
    """The worker's lease epoch is no longer current: its write is refused."""


def hold(conn: sa.Connection, session_id: str, worker_id: str, lease_epoch: int) -> SessionRow:
    """Lock the session row and check that `worker_id` still holds it at `lease_epoch`; every
    write a worker makes about a session goes through this first. Raises StaleLeaseError."""
    session = get_session(conn, None, session_id, for_update=True)
    check_holder(session, worker_id, lease_epoch)
    return session


def check_holder(session: SessionRow, worker_id: str, lease_epoch: int) -> None:
    """Raise StaleLeaseError unless `worker_id` holds `session` (as read, locked) at
    `lease_epoch`."""
    if session.worker_id != worker_id or session.lease_epoch != lease_epoch:
        raise StaleLeaseError(
            f"{worker_id} epoch {lease_epoch} no longer holds {session.id} "
            f"({session.worker_id} epoch {session.lease_epoch} does)"
        )


def _seconds_ago(seconds: float) -> sa.ColumnElement[Any]:
    return sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds)


def heartbeat_worker(conn: sa.Connection, worker_id: str, info: Mapping[str, Any]) -> None:
    stmt = sa.dialects.postgresql.insert(workers).values(id=worker_id, info=dict(info))
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["id"], set_={"heartbeat_at": sa.func.now(), "info": dict(info)}
        )
    )


def unable_to_host(info: Mapping[str, Any], base_model: str) -> str | None:
    """Why a worker whose heartbeat says `info` cannot host `base_model`, or None if it can.
    A worker reports the models it can load (`models`) and why not the others (`refused`); a
    model it has not judged yet (registered since its last heartbeat, or a worker that reports
    nothing) is taken to be hostable: the worker judges it within a heartbeat."""
    refused = info.get("refused") or {}
    return None if base_model not in refused else str(refused[base_model])


def hosts(
    conn: sa.Connection, ttl_seconds: float, base_model: str
) -> tuple[list[str], dict[str, str]]:
    """The live workers that can host `base_model`, and why each other live worker cannot."""
    rows = conn.execute(
        sa.select(workers.c.id, workers.c.info)
        .where(workers.c.heartbeat_at > _seconds_ago(ttl_seconds))
        .order_by(workers.c.id)
    ).all()
    able, reasons = [], {}
    for row in rows:
        why = unable_to_host(row.info or {}, base_model)
        if why is None:
            able.append(row.id)
        else:
            reasons[row.id] = why
    return able, reasons


def with_room(
    conn: sa.Connection, worker_ids: Sequence[str], new: admission.Held
) -> tuple[list[str], dict[str, str]]:
    """Those of `worker_ids` with room in their memory for `new` beside the sessions they hold
    (`admission.room`; a worker that reports no budget is taken to have room), and why each
    other has none, with the numbers.

    Takes the placement lock, held until `conn`'s transaction ends: the room read here is still
    there when the caller places the session in the same transaction, since no other create or
    claim reads room meanwhile (two creates at once both saw room for one, and both were
    placed)."""
    conn.execute(sa.select(sa.func.pg_advisory_xact_lock(PLACEMENT_LOCK)))
    rows = conn.execute(
        sa.select(workers.c.id, workers.c.info).where(workers.c.id.in_(worker_ids))
    ).all()
    infos = {row.id: row.info for row in rows}
    held = admission.held_by(conn, worker_ids)
    roomy, full = [], {}
    for worker_id in worker_ids:
        why, _ = admission.room(worker_id, infos.get(worker_id) or {}, held[worker_id], new)
        if why is None:
            roomy.append(worker_id)
        else:
            full[worker_id] = why
    return roomy, full


def has_room_for(conn: sa.Connection, worker_id: str, session_id: str) -> bool:
    """Whether `worker_id` has room for the existing session `session_id` beside the sessions
    it holds (`with_room`): a worker claims only sessions it can run."""
    row = conn.execute(
        sa.select(sessions.c.base_model, sessions.c.kind, sessions.c.lora_config).where(
            sessions.c.id == session_id
        )
    ).one()
    need = admission.Held(session_id, row.base_model, row.kind, dict(row.lora_config or {}))
    roomy, _ = with_room(conn, [worker_id], need)
    return bool(roomy)


def live_workers(conn: sa.Connection, ttl_seconds: float) -> list[str]:
    """Workers that heartbeated within `ttl_seconds`, by id."""
    return list(
        conn.execute(
            sa.select(workers.c.id)
            .where(workers.c.heartbeat_at > _seconds_ago(ttl_seconds))
            .order_by(workers.c.id)
        ).scalars()
    )


def place_session(
    conn: sa.Connection,
    session_id: str,
    ttl_seconds: float,
    base_model: str,
    new: admission.Held | None = None,
) -> str | None:
    """Lease an unleased session to the live worker with the fewest active sessions among those
    that can host its base model (and, given `new`, the session as admission counts it, that
    have room for it: `with_room`).

    Returns the worker id, or None when no such worker is alive (one claims it when it starts).
    """
    live, _ = hosts(conn, ttl_seconds, base_model)
    if new is not None and live:
        live, _ = with_room(conn, live, new)
    if not live:
        return None
    load: dict[str, int] = dict(
        conn.execute(
            sa.select(sessions.c.worker_id, sa.func.count())
            .where(sessions.c.worker_id.in_(live), sessions.c.status.in_(ACTIVE_STATUSES))
            .group_by(sessions.c.worker_id)
        ).all()
    )
    worker_id = min(live, key=lambda w: (load.get(w, 0), w))
    placed = lease_session(conn, session_id, worker_id, only_if_unleased=True, reason="placed")
    return worker_id if placed else None


def lease_session(
    conn: sa.Connection,
    session_id: str,
    worker_id: str,
    *,
    only_if_unleased: bool,
    reason: str | None = None,
) -> bool:
    """Give a session's lease to a worker with epoch + 1 (appends SessionLeased). `reason`
    (the lease-change counter's label): "placed", "claimed" or "orphan"; by default "claimed"
    for an unleased session, "orphan" for one taken from another worker."""
    query = sa.update(sessions).where(sessions.c.id == session_id)
    if only_if_unleased:
        query = query.where(sessions.c.worker_id.is_(None))
    row = conn.execute(
        query.values(worker_id=worker_id, lease_epoch=sessions.c.lease_epoch + 1).returning(
            sessions.c.tenant_id, sessions.c.lease_epoch
        )
    ).first()
    if row is None:
        return False
    events.append(
        conn,
        session_id,
        row.tenant_id,
        "SessionLeased",
        {"worker_id": worker_id, "epoch": row.lease_epoch},
    )
    metrics.count_lease_change(conn, reason or ("claimed" if only_if_unleased else "orphan"))
    return True


def unleased_sessions(
    conn: sa.Connection, limit: int = 50, base_models: Collection[str] | None = None
) -> list[str]:
    """Active sessions no worker holds (only those on `base_models`, when given)."""
    query = sa.select(sessions.c.id).where(
        sessions.c.worker_id.is_(None), sessions.c.status.in_(ACTIVE_STATUSES)
    )
    if base_models is not None:
        query = query.where(sessions.c.base_model.in_(list(base_models)))
    return list(
        conn.execute(
            query.order_by(sessions.c.updated_at).limit(limit).with_for_update(skip_locked=True)
        ).scalars()
    )


def sessions_leased_to(conn: sa.Connection, worker_id: str) -> list[str]:
    return list(
        conn.execute(
            sa.select(sessions.c.id).where(
                sessions.c.worker_id == worker_id, sessions.c.status.in_(ACTIVE_STATUSES)
            )
        ).scalars()
    )


def worker_load(conn: sa.Connection, worker_id: str) -> tuple[int, int]:
    """(active sessions leased to `worker_id`, pending operations of those sessions), in one
    statement: the worker's gauges read it at every metrics scrape."""
    mine = sa.and_(sessions.c.worker_id == worker_id, sessions.c.status.in_(ACTIVE_STATUSES))
    live = sa.select(sa.func.count()).select_from(sessions).where(mine).scalar_subquery()
    queued = (
        sa.select(sa.func.count())
        .select_from(operations.join(sessions, operations.c.session_id == sessions.c.id))
        .where(mine, operations.c.status == OpStatus.PENDING)
        .scalar_subquery()
    )
    row = conn.execute(sa.select(live, queued)).one()
    return int(row[0]), int(row[1])


def orphaned_sessions(
    conn: sa.Connection,
    ttl_seconds: float,
    limit: int = 50,
    base_models: Collection[str] | None = None,
) -> list[str]:
    """Active sessions leased to a worker that has not heartbeated within `ttl_seconds` (only
    those on `base_models`, when given)."""
    live = sa.select(workers.c.id).where(workers.c.heartbeat_at > _seconds_ago(ttl_seconds))
    query = sa.select(sessions.c.id).where(
        sessions.c.worker_id.is_not(None),
        sessions.c.worker_id.not_in(live),
        sessions.c.status.in_(ACTIVE_STATUSES),
    )
    if base_models is not None:
        query = query.where(sessions.c.base_model.in_(list(base_models)))
    return list(conn.execute(query.limit(limit).with_for_update(skip_locked=True)).scalars())


def release_leases(conn: sa.Connection, worker_id: str, reason: str) -> list[str]:
    """Take every session away from `worker_id` (appends SessionReleased to each), so a live
    worker claims them at once. Returns their ids."""
    rows = conn.execute(
        sa.update(sessions)
        .where(sessions.c.worker_id == worker_id)
        .values(worker_id=None)
        .returning(sessions.c.id, sessions.c.tenant_id, sessions.c.lease_epoch)
    ).all()
    for row in rows:
        events.append(
            conn,
            row.id,
            row.tenant_id,
            "SessionReleased",
            {"worker_id": worker_id, "epoch": row.lease_epoch, "reason": reason},
        )
    metrics.count_lease_change(conn, "released", len(rows))
    return [row.id for row in rows]


def retire_worker(conn: sa.Connection, worker_id: str, reason: str) -> list[str]:
    """A worker that stopped or died: forget its heartbeat (no new session is placed on it) and
    release its leases. Returns the released session ids."""
    conn.execute(sa.delete(workers).where(workers.c.id == worker_id))
    return release_leases(conn, worker_id, reason)
