"""The audit log of a tenant (Tinker's `AdminClient.get_audit_log`), read from the event store.

One entry per control-plane event of one UTC day, named `<resource>_<action>`: a session's
lifecycle (`training_run_create`, `_stop`, `_expire`, `_fail`, `_diverge`, `_recover`, `_fork`;
`sampling_session_*` for a base-model sampler, `replay_sandbox_*` for a replay), checkpoint saves
and deletions (`checkpoint_create`, `checkpoint_delete`) and loads (`checkpoint_read`).
Operations are not audit entries (a session's trace export shows them). At most MAX_ENTRIES a
day, oldest first. Imports nothing from api, engine, worker, Flask or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

import sqlalchemy as sa

from treadle.platform.eventlog.schema import events, operations, sessions
from treadle.platform.tenancy.tenants import Principal

MAX_ENTRIES = 10_000
MAX_FIELD_JSON = 200  # an event's fields longer than this as JSON stay out of the details
CATEGORIES = ("all", "checkpoints", "projects", "teams", "organizations")

SESSION_ACTIONS = {
    "SessionCreated": "create",
    "SessionStopped": "stop",
    "SessionExpired": "expire",
    "SessionFailed": "fail",
    "SessionDiverged": "diverge",
    "SessionRecovered": "recover",
    "SessionForked": "fork",  # heads a fork's log (lineage)
    "ReplayRequested": "start",  # heads a replay sandbox's log (lineage)
}
CHECKPOINT_ACTIONS = {"CheckpointSaved": "create", "CheckpointDeleted": "delete"}
RESOURCES = {"training": "training_run", "sampling": "sampling_session", "replay": "replay_sandbox"}
LOAD = "load_weights"  # an OperationRequested of this type reads a checkpoint


@dataclass(frozen=True)
class AuditEntry:
    timestamp: datetime
    event: str
    details: dict[str, Any]
    model_id: str | None = None  # set on checkpoint events only (Tinker's deprecated fields)
    tinker_path: str | None = None
    purpose: str | None = None


@dataclass(frozen=True)
class AuditPage:
    entries: list[AuditEntry]
    truncated: bool  # the day held more than MAX_ENTRIES entries


def read_day(conn: sa.Connection, principal: Principal, category: str, day: date) -> AuditPage:
    """The tenant's entries of `category` (one of CATEGORIES) on `day` (UTC), oldest first.
    Treadle has no projects, teams or organizations: those categories are empty."""
    assert category in CATEGORIES, category
    if category not in ("all", "checkpoints"):
        return AuditPage([], truncated=False)
    kinds = list(CHECKPOINT_ACTIONS) + ([] if category == "checkpoints" else list(SESSION_ACTIONS))
    start = datetime.combine(day, time.min, UTC)
    e, prev = events.alias("e"), events.alias("prev")
    is_load = sa.and_(e.c.type == "OperationRequested", e.c.data["type"].astext == LOAD)
    # A checkpoint save is appended by the worker beside the OperationCompleted of the
    # save_weights request that made it (in its transaction; before it since that completion
    # records the version): that request's key is its actor.
    query = (
        sa.select(
            e.c.type,
            e.c.data,
            e.c.session_id,
            e.c.created_at,
            sa.func.coalesce(e.c.actor, operations.c.actor).label("actor"),
            sessions.c.kind,
        )
        .select_from(
            e.join(sessions, sessions.c.id == e.c.session_id)
            .outerjoin(
                prev,
                sa.and_(
                    e.c.type == "CheckpointSaved",
                    prev.c.session_id == e.c.session_id,
                    # right before it, or (a save that records its version) right after
                    prev.c.seq.in_([e.c.seq - 1, e.c.seq + 1]),
                    prev.c.type == "OperationCompleted",
                    prev.c.data["result"]["path"].astext == e.c.data["path"].astext,
                ),
            )
            .outerjoin(operations, operations.c.request_id == prev.c.data["request_id"].astext)
        )
        .where(
            sessions.c.tenant_id == principal.tenant_id,
            e.c.tenant_id == principal.tenant_id,
            e.c.created_at >= start,
            e.c.created_at < start + timedelta(days=1),
            sa.or_(e.c.type.in_(kinds), is_load),
        )
        .order_by(e.c.created_at, e.c.position)
        .limit(MAX_ENTRIES + 1)
    )
    rows = conn.execute(query).all()
    entries = [_entry(r) for r in rows[:MAX_ENTRIES]]
    return AuditPage(entries, truncated=len(rows) > MAX_ENTRIES)


def _entry(row: Any) -> AuditEntry:
    data: Mapping[str, Any] = row.data or {}
    details: dict[str, Any] = {"actor": row.actor, "model_id": row.session_id}
    if row.type == "OperationRequested":  # a checkpoint load
        payload = data.get("payload") or {}
        path = payload.get("path")
        details.update(
            tinker_path=path,
            purpose=LOAD,
            request_id=data.get("request_id"),
            seq_id=data.get("seq_id"),
            with_optimizer=payload.get("optimizer"),
        )
        return AuditEntry(row.created_at, "checkpoint_read", details, row.session_id, path, LOAD)
    details = {**_small_fields(data), **details}  # the event's fields never hide who and what
    if row.type in CHECKPOINT_ACTIONS:
        path = data.get("path")
        details["tinker_path"] = path
        details.pop("path", None)
        event = f"checkpoint_{CHECKPOINT_ACTIONS[row.type]}"
        return AuditEntry(row.created_at, event, details, row.session_id, path)
    resource = RESOURCES.get(row.kind, row.kind)
    return AuditEntry(row.created_at, f"{resource}_{SESSION_ACTIONS[row.type]}", details)


def _small_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: value
        for key, value in data.items()
        if len(json.dumps(value, default=str)) <= MAX_FIELD_JSON
    }
