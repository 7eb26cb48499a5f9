"""The event store: an append-only log, one stream per session.

`append` takes the session row's lock (it bumps `sessions.last_event_seq`) and inserts the event
in one statement, so appends to one session are serialised and numbered 1, 2, 3, ... without
gaps; the database refuses UPDATE and DELETE on `events`. Event types are past-tense facts.
Each append is counted by type once its transaction commits (`treadle_event_appends_total`).
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from treadle.platform import metrics
from treadle.platform.errors import NotFoundError
from treadle.platform.eventlog.schema import events

EVENT_TYPES = (
    "SessionCreated",
    "SessionLeased",
    "SessionReleased",
    "SessionRecovered",
    "SessionDiverged",
    "SessionFailed",
    "SessionStopped",
    "SessionExpired",
    "SessionDeleted",  # SageMaker's DeleteTrainingSession: its name is free again
    "OperationRequested",
    "OperationCompleted",
    "OperationFailed",
    "OperationsSkipped",
    "CheckpointSaved",
    "CheckpointDeleted",
    "AutoCheckpointSaved",
    "SessionForked",
    "ReplayRequested",
    "BaseModelRegistered",  # the model registry's streams, `base_model:<name>`
    "BaseModelRetired",
)


@dataclass(frozen=True)
class Event:
    position: int
    session_id: str
    seq: int
    type: str
    data: Mapping[str, Any]
    tenant_id: str
    actor: str | None
    created_at: datetime


# One statement, so one round trip: lock the session row and bump its counter, then insert the
# event under that number. Raw SQL on purpose: appends are the hot path (every admission and every
# settlement), and building and compiling Core statements per call cost the client more CPU than
# PostgreSQL spent running them (docs/benchmarks.md, "Event store"). benchmarks/events.py also
# runs this statement through pgbench.
def append_sql(*, also_set: str = "", then: str = "") -> str:
    """The append statement. `also_set` (", col = expr, ...") adds to the session row's update,
    which locks and updates the row anyway; `then` ends the statement with one that reads the new
    event from `appended` (default: its position, seq and created_at). Both fold a write that
    would be a round trip of its own into the append (see `append_then`)."""
    return f"""
WITH bumped AS (
    UPDATE sessions SET last_event_seq = last_event_seq + 1, updated_at = now(){also_set}
    WHERE id = %(session_id)s
    RETURNING last_event_seq
), appended AS (
    INSERT INTO events (session_id, seq, type, data, tenant_id, actor)
    SELECT %(session_id)s, last_event_seq, %(type)s, CAST(%(data)s AS jsonb), %(tenant_id)s,
           %(actor)s
    FROM bumped
    RETURNING position, seq, created_at
)
{then or "SELECT position, seq, created_at FROM appended"}
"""


APPEND_SQL = append_sql()


def append(
    conn: sa.Connection,
    session_id: str,
    tenant_id: str,
    type: str,
    data: Mapping[str, Any],
    *,
    actor: str | None = None,
) -> Event:
    """Append one event to a session's stream inside the caller's transaction.

    The session row stays locked until the caller's transaction ends, so appends to one session
    are serialised and numbered without gaps; other sessions' appends do not wait for it. A seq
    already taken (a row written around `append`) fails on `uq_events_session_seq`.
    Raises NotFoundError when the session does not exist.
    """
    row = append_then(conn, APPEND_SQL, session_id, tenant_id, type, data, actor=actor)
    return Event(row.position, session_id, row.seq, type, data, tenant_id, actor, row.created_at)


def append_then(
    conn: sa.Connection,
    sql: str,
    session_id: str,
    tenant_id: str,
    type: str,
    data: Mapping[str, Any],
    *,
    actor: str | None = None,
    params: Mapping[str, Any] | None = None,
) -> sa.Row[Any]:
    """Append as `append` does, with a statement from `append_sql` (built once by the caller)
    and its own `params`; returns the row its `then` answers. Raises NotFoundError when the
    session does not exist (the statement answered nothing)."""
    assert type in EVENT_TYPES, type
    row = conn.exec_driver_sql(
        sql,
        {
            **(params or {}),
            "session_id": session_id,
            "type": type,
            "data": json.dumps(dict(data)),
            "tenant_id": tenant_id,
            "actor": actor,
        },
    ).first()
    if row is None:
        raise NotFoundError(f"session {session_id} not found")
    metrics.count_append(conn, type)
    return row


def read_stream(
    conn: sa.Connection, session_id: str, *, types: tuple[str, ...] | None = None
) -> list[Event]:
    query = sa.select(events).where(events.c.session_id == session_id).order_by(events.c.seq)
    if types:
        query = query.where(events.c.type.in_(types))
    return [_event(r) for r in conn.execute(query)]


def read_at(conn: sa.Connection, position: int) -> Event:
    row = conn.execute(sa.select(events).where(events.c.position == position)).one()
    return _event(row)


def read_many(conn: sa.Connection, positions: list[int]) -> dict[int, Event]:
    """Events by position, in one query."""
    if not positions:
        return {}
    rows = conn.execute(sa.select(events).where(events.c.position.in_(positions)))
    return {r.position: _event(r) for r in rows}


def _event(row: sa.Row[Any]) -> Event:
    return Event(
        position=row.position,
        session_id=row.session_id,
        seq=row.seq,
        type=row.type,
        data=row.data,
        tenant_id=row.tenant_id,
        actor=row.actor,
        created_at=row.created_at,
    )
