"""Audit reads: a session's events page by page and its per-operation timeline (the session
listing is in `session_listing`).

Read-only SQL over `events`, `sessions` and `usage`. Every read is scoped by tenant: another
tenant's session answers 404 exactly like a missing one, and only the operator reads across
tenants. Large payloads and results are summarised (marked `"summary": true`) unless asked for
in full. Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, TypeGuard

import sqlalchemy as sa

from treadle.platform.billing.prices import TOKEN_CLASSES
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import events as events_core
from treadle.platform.eventlog import results
from treadle.platform.eventlog.schema import events
from treadle.platform.sessions.sessions import ACTIVE_STATUSES, get_session
from treadle.platform.tenancy.tenants import Principal

MAX_LIMIT = 1000
SETTLEMENTS = ("OperationCompleted", "OperationFailed")
SUMMARY_BYTES = 1024  # a field whose JSON is larger is summarised unless `full`


def check_limit(limit: int, what: str = "limit") -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise ValidationError(f"{what} must be between 1 and {MAX_LIMIT}, got {limit}")
    return limit


def check_types(types: Iterable[str]) -> tuple[str, ...]:
    """Event type names, each one of EVENT_TYPES; a 400 naming the unknown ones otherwise."""
    names = tuple(dict.fromkeys(t for t in types if t))
    unknown = [t for t in names if t not in events_core.EVENT_TYPES]
    if unknown:
        raise ValidationError(
            f"unknown event type {', '.join(repr(t) for t in unknown)}; use any of "
            f"{', '.join(events_core.EVENT_TYPES)}"
        )
    return names


def _session(conn: sa.Connection, principal: Principal, session_id: str) -> Any:
    """The session, scoped by the caller's tenant (the operator reads any tenant's)."""
    return get_session(conn, None if principal.is_operator else principal, session_id)


# --- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class EventPage:
    """Events after a position, oldest first; `next_after` is the cursor for the next page (the
    last position returned, or the one asked after when none was)."""

    session_id: str
    status: str  # the session's status when the page was read (read before its events)
    events: list[events_core.Event]
    next_after: int
    has_more: bool

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES


def events_page(
    conn: sa.Connection,
    principal: Principal,
    session_id: str,
    *,
    after: int = 0,
    limit: int = 100,
    types: Iterable[str] = (),
    full: bool = False,
) -> EventPage:
    """One page of a session's events with position > `after`. Within a session, positions
    grow with seq (`events.append` serialises a session's appends under its row lock), so the
    page walks the (session_id, seq) index and a cursor never skips nor repeats an event."""
    check_limit(limit)
    if after < 0:
        raise ValidationError(f"after must be a position >= 0 (0: from the start), got {after}")
    wanted = check_types(types)
    session = _session(conn, principal, session_id)
    after_seq = (
        sa.select(events.c.seq)
        .where(events.c.session_id == session_id, events.c.position == after)
        .scalar_subquery()
    )
    query = (
        sa.select(events)
        .where(
            events.c.session_id == session_id,
            events.c.position > after,
            events.c.seq > sa.func.coalesce(after_seq, 0),
        )
        .order_by(events.c.seq)
        .limit(limit + 1)
    )
    if wanted:
        query = query.where(events.c.type.in_(wanted))
    rows = conn.execute(query).all()
    found = [
        events_core.Event(
            position=r.position,
            session_id=r.session_id,
            seq=r.seq,
            type=r.type,
            data=r.data if full else summarize(r.type, r.data),
            tenant_id=r.tenant_id,
            actor=r.actor,
            created_at=r.created_at,
        )
        for r in rows[:limit]
    ]
    next_after = found[-1].position if found else after
    return EventPage(session.id, session.status, found, next_after, len(rows) > limit)


def summarize(event_type: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """An event's data with its large parts summarised: a request's training data and prompt,
    a result's per-token outputs and sequences, and any other field over SUMMARY_BYTES."""
    out = dict(data)
    payload, result = out.get("payload"), out.get("result")
    if event_type == "OperationRequested" and isinstance(payload, dict):
        out["payload"] = _payload_summary(str(out.get("type")), payload)
    if event_type == "OperationCompleted" and isinstance(result, dict):
        out["result"] = _result_summary(out.get("type"), result)
    return {k: _small(v) for k, v in out.items()}


def _payload_summary(op_type: str, payload: dict[str, Any]) -> dict[str, Any]:
    if op_type == "forward_backward" and isinstance(payload.get("data"), list):
        datums = [d for d in payload["data"] if isinstance(d, dict)]
        rest = {k: _small(v) for k, v in payload.items() if k != "data"}
        return {
            "summary": True,
            **rest,
            "datums": len(payload["data"]),
            "tokens": sum(len(d.get("tokens") or ()) for d in datums),
            "loss_fn_inputs": sorted({n for d in datums for n in d.get("loss_fn_inputs") or {}}),
        }
    if op_type == "sample" and isinstance(payload.get("prompt"), list):
        rest = {k: _small(v) for k, v in payload.items() if k != "prompt"}
        return {"summary": True, **rest, "prompt_tokens": len(payload["prompt"])}
    return _generic(payload)


def _result_summary(op_type: Any, result: dict[str, Any]) -> dict[str, Any]:
    """A forward_backward's outputs and a sample's sequences as counts; the rest as `_generic`,
    as is a result that does not read as its type (a damaged log is shown, not refused)."""
    try:
        typed = results.read(op_type, result)
    except ValueError:
        return _generic(result)
    if isinstance(typed, results.ForwardBackwardOutput):
        return {
            "summary": True,
            "metrics": _small(typed.metrics),
            "loss_fn_outputs": len(typed.loss_fn_outputs),
        }
    if isinstance(typed, results.SampleOutput):
        prompt = typed.prompt_logprobs
        return {
            "summary": True,
            "sequences": len(typed.sequences),
            "sampled_tokens": sum(len(s.tokens) for s in typed.sequences),
            "stop_reasons": [s.stop_reason for s in typed.sequences],
            "prompt_logprobs": None if prompt is None else len(prompt),
        }
    return _generic(result)


def _generic(value: dict[str, Any]) -> dict[str, Any]:
    out = {k: _small(v) for k, v in value.items()}
    if any(out[k] is not value[k] for k in value):
        out = {"summary": True, **out}
    return out


def _small(value: Any) -> Any:
    """`value`, or a note of its size when its JSON is over SUMMARY_BYTES."""
    if not isinstance(value, list | dict):
        return value
    size = len(json.dumps(value, separators=(",", ":")))
    if size <= SUMMARY_BYTES:
        return value
    kind = "list" if isinstance(value, list) else "object"
    return {"summary": True, "kind": kind, "items": len(value), "bytes": size}


# --- timeline -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimelineRow:
    """One operation (its request joined with its completion or failure) or one session-level
    event (lease, recovery, checkpoint, stop, ...), at the seq of its event."""

    seq: int
    time: datetime  # when it was requested (or the event appended)
    kind: str  # "operation" or "event"
    type: str  # the operation's type, or the event's
    actor: str | None
    request_id: str | None = None
    seq_id: int | None = None
    sampler_id: str | None = None
    status: str | None = None  # pending, completed or failed
    completed_at: datetime | None = None
    queue_wait_ms: float | None = None  # request to start of execution
    execution_ms: float | None = None
    tokens: Mapping[str, int] | None = None
    metrics: Mapping[str, Any] | None = None
    error: Mapping[str, Any] | None = None
    detail: Mapping[str, Any] | None = None  # a session-level event's data

    @property
    def loss(self) -> float | None:
        value = (self.metrics or {}).get("loss:sum")
        return float(value) if isinstance(value, int | float) else None

    @property
    def outcome(self) -> str:
        """A short text: the loss (or metrics) of a completed operation, the error of a failed
        one, "pending" while it runs."""
        if self.kind != "operation":
            return ""
        if self.status == "failed":
            err = self.error or {}
            return f"error {err.get('code', '?')}: {err.get('message', '')}"
        if self.status != "completed":
            return "pending"
        if self.loss is not None:
            return f"loss:sum={self.loss:.6g}"
        shown = [f"{k}={v:.6g}" for k, v in (self.metrics or {}).items() if _number(v)][:2]
        return " ".join(shown) or "ok"

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(time=_iso(self.time), completed_at=_iso(self.completed_at))
        return {**out, "loss": self.loss, "outcome": self.outcome}


@dataclass(frozen=True)
class TimelinePage:
    session_id: str
    status: str
    rows: list[TimelineRow]
    next_after: int  # the seq to continue after
    has_more: bool


def timeline(
    conn: sa.Connection,
    principal: Principal,
    session_id: str,
    *,
    after: int = 0,
    limit: int = 100,
) -> TimelinePage:
    """Timeline rows with seq > `after`, in seq order: each OperationRequested joined (one
    lateral lookup) with the OperationCompleted/OperationFailed that settled it, and every
    other event but those settlements as it is."""
    check_limit(limit)
    if after < 0:
        raise ValidationError(f"after must be a seq >= 0 (0: from the start), got {after}")
    session = _session(conn, principal, session_id)
    e, c = events.alias("e"), events.alias("c")
    settled = (
        sa.select(
            c.c.type.label("settled_type"),
            c.c.created_at.label("settled_at"),
            c.c.data["duration_ms"].label("duration_ms"),
            c.c.data["tokens"].label("tokens"),
            c.c.data["result"]["metrics"].label("metrics"),
            c.c.data["error"].label("error"),
        )
        .where(
            e.c.type == "OperationRequested",
            c.c.session_id == e.c.session_id,
            c.c.seq > e.c.seq,
            c.c.type.in_(SETTLEMENTS),
            c.c.data["request_id"].astext == e.c.data["request_id"].astext,
        )
        .order_by(c.c.seq)
        .limit(1)
        .lateral("s")
    )
    requested = e.c.type == "OperationRequested"
    query = (
        sa.select(
            e.c.seq,
            e.c.type,
            e.c.created_at,
            e.c.actor,
            e.c.data["request_id"].astext.label("request_id"),
            e.c.data["type"].astext.label("op_type"),
            e.c.data["seq_id"].label("seq_id"),
            e.c.data["sampler_id"].astext.label("sampler_id"),
            sa.case((requested, sa.null()), else_=e.c.data).label("detail"),
            *settled.c,
        )
        .select_from(e.outerjoin(settled, sa.true()))
        .where(e.c.session_id == session_id, e.c.seq > after, e.c.type.not_in(SETTLEMENTS))
        .order_by(e.c.seq)
        .limit(limit + 1)
    )
    rows = conn.execute(query).all()
    found = [_timeline_row(r) for r in rows[:limit]]
    next_after = found[-1].seq if found else after
    return TimelinePage(session.id, session.status, found, next_after, len(rows) > limit)


def _timeline_row(r: Any) -> TimelineRow:
    if r.type != "OperationRequested":
        return TimelineRow(r.seq, r.created_at, "event", r.type, r.actor, detail=r.detail)
    duration = float(r.duration_ms) if _number(r.duration_ms) else None
    wait = None
    if duration is not None and r.settled_at is not None:
        started = (r.settled_at - r.created_at).total_seconds() * 1000 - duration
        wait = round(max(0.0, started), 3)
    status = {"OperationCompleted": "completed", "OperationFailed": "failed"}
    tokens = r.tokens if isinstance(r.tokens, dict) else None
    return TimelineRow(
        seq=r.seq,
        time=r.created_at,
        kind="operation",
        type=r.op_type,
        actor=r.actor,
        request_id=r.request_id,
        seq_id=int(r.seq_id) if _number(r.seq_id) else None,
        sampler_id=r.sampler_id,
        status=status.get(r.settled_type, "pending"),
        completed_at=r.settled_at,
        queue_wait_ms=wait,
        execution_ms=duration,
        tokens=None if tokens is None else {k: int(tokens.get(k, 0)) for k in TOKEN_CLASSES},
        metrics=r.metrics if isinstance(r.metrics, dict) else None,
        error=r.error if isinstance(r.error, dict) else None,
    )


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()
