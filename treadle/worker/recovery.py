"""Rebuilding a training session's adapter from its log: the newest automatic checkpoint at or
before the target seq_id, then a verified replay of the state-changing operations after it.

Each operation is replayed with the result it first stored at hand (`handlers.Call.recorded`:
a forward_backward runs with the pass budget it recorded, whatever this worker's). Each replayed
step's state hashes are compared with those its completion recorded, and a loaded
checkpoint's with those recorded when it was written; any difference raises `Diverged` (the
caller marks the session diverged rather than train on weights its log does not describe). A
rebuild that cannot find what it needs raises `Unrecoverable`. `recover` is the rebuild of a
session by its new holder, counted (its outcome, and each operation it replayed). Writing automatic checkpoints and
pruning old ones lives here too. Imports platform and the engine; never api.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from treadle.engine import EngineAPI, Interrupt
from treadle.platform.checkpoints import auto_checkpoints
from treadle.platform.checkpoints.storage import ObjectStore
from treadle.platform.errors import ConflictError, GoneError, TreadleError
from treadle.platform.eventlog import events
from treadle.platform.eventlog.optypes import (
    OptimStep,
    Rebuild,
    RebuildMode,
    SaveWeightsForSampler,
    parse_payload,
)
from treadle.platform.operations import operations
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.sessions.sessions import SessionRow
from treadle.worker import checkpoint_io, handlers, telemetry

log = logging.getLogger(__name__)


class Diverged(Exception):
    """Replaying the log did not reproduce the state it recorded."""

    def __init__(self, seq_id: int, what: str, part: str, expected: str, actual: str) -> None:
        super().__init__(f"seq {seq_id} ({what}): {part} hash {actual} != recorded {expected}")
        self.seq_id, self.what, self.part = seq_id, what, part
        self.expected, self.actual = expected, actual
        self.replayed = self.verified = 0  # how far the replay got before it (set by rebuild)


class Unrecoverable(Exception):
    """The session cannot be rebuilt: something its replay needs is gone."""


@dataclass(frozen=True)
class Rebuilt:
    from_seq: int  # the recovery point's seq_id, or -1 (replayed from the start)
    to_seq: int
    replayed: int
    optim_steps_since_point: int
    seconds: float
    verified: int = 0  # replayed operations whose state matched the hashes first recorded
    original_seconds: float = 0.0  # what the replayed operations took when they first ran


def recover(
    db: sa.Engine,
    engine: EngineAPI,
    store: ObjectStore,
    session: SessionRow,
    *,
    adapter_id: str,
    up_to_seq: int,
    interrupt: Interrupt | None = None,
) -> Rebuilt:
    """`rebuild` the adapter of a session this worker now holds, counting the outcome
    (recovered, diverged or failed; a transient error is retried, not counted) and each
    operation replayed."""
    try:
        rebuilt = rebuild(
            db, engine, store, session, adapter_id=adapter_id, up_to_seq=up_to_seq,
            interrupt=interrupt, on_replay=lambda op_type: telemetry.REPLAYED.labels(op_type).inc(),
        )  # fmt: skip
    except Diverged:
        telemetry.RECOVERIES.labels("diverged").inc()
        raise
    except Unrecoverable:
        telemetry.RECOVERIES.labels("failed").inc()
        raise
    telemetry.RECOVERIES.labels("recovered").inc()
    return rebuilt


def rebuild(
    db: sa.Engine,
    engine: EngineAPI,
    store: ObjectStore,
    session: SessionRow,
    *,
    adapter_id: str,
    up_to_seq: int,
    snapshots: Container[str] | None = None,
    interrupt: Interrupt | None = None,
    from_start: bool = False,
    on_replay: Callable[[str], None] | None = None,
) -> Rebuilt:
    """Build `adapter_id` as `session`'s adapter stood after `up_to_seq`, verified step by step.

    `snapshots` limits which samplers' snapshots the replay re-creates (None: all of them).
    `from_start` replays every operation the log can replay (an audit's replay): it starts from
    a copy of a loaded checkpoint only, never from an automatic one. `on_replay` is called with
    the type of each operation replayed.
    Raises Diverged, Unrecoverable, or what the store or database raise (transient: retry).
    """
    started = time.monotonic()
    with db.connect() as conn:
        points = auto_checkpoints.newest_first(conn, session.id, at_or_before=up_to_seq)
    if from_start:
        points = [p for p in points if p.kind == auto_checkpoints.LOADED]
    if engine.has_adapter(adapter_id):
        engine.drop_adapter(adapter_id)
    point = _load_newest_point(engine, store, session, adapter_id, points)
    after = point.seq_id if point is not None else -1
    with db.connect() as conn:
        done = operations.completed_training_ops(
            conn, session.id, after_seq=after, up_to_seq=up_to_seq
        )
        requests = events.read_many(conn, [op.request_position for op in done])
        took = operations.durations(conn, session.id, after_seq=after, up_to_seq=up_to_seq)
    replayed = steps = verified = 0
    original = 0.0
    for op in done:
        payload = parse_payload(op.type, requests[op.request_position].data["payload"])
        if not payload.is_replayed:
            continue
        if (
            isinstance(payload, SaveWeightsForSampler)
            and snapshots is not None
            and payload.snapshot not in snapshots
        ):
            continue
        if interrupt is not None:
            interrupt()
        call = handlers.Call(
            engine=engine,
            store=store,
            tenant_id=session.tenant_id,
            session_id=session.id,
            base_model=session.base_model,
            adapter_id=adapter_id,
            seq_id=op.seq_id,
            live=False,
            recorded=op.result,
        )
        try:
            try:
                handlers.run(call, payload)
            except FileNotFoundError as exc:
                raise Unrecoverable(
                    f"replaying seq {op.seq_id} ({op.type}) needs files that are gone: {exc}"
                ) from exc
            except TreadleError as exc:  # it ran once; running it again must not fail
                raise Diverged(op.seq_id, op.type, "outcome", "completed", exc.message) from exc
            replayed += 1
            if on_replay is not None:
                on_replay(op.type)
            if payload.changes_state and op.state:
                _verify(engine, adapter_id, op.seq_id, op.type, op.state)
                verified += 1
        except Diverged as exc:
            exc.replayed, exc.verified = replayed, verified
            raise
        steps += isinstance(payload, OptimStep)
        original += took.get(op.seq_id, 0.0)
    return Rebuilt(
        after, up_to_seq, replayed, steps, time.monotonic() - started, verified, original
    )


def _load_newest_point(
    engine: EngineAPI,
    store: ObjectStore,
    session: SessionRow,
    adapter_id: str,
    points: list[auto_checkpoints.AutoCheckpoint],
) -> auto_checkpoints.AutoCheckpoint | None:
    """Load the newest recovery point whose files are there (an older one, or none, if the
    newest are gone), and check it holds the state recorded when it was written."""
    for point in points:
        try:
            checkpoint_io.load(
                engine, store, adapter_id, session.base_model, point.storage_prefix,
                with_optimizer=True,
            )  # fmt: skip
        except FileNotFoundError:
            log.warning("%s: recovery point at seq %d is gone", session.id, point.seq_id)
            continue
        except TreadleError as exc:  # unreadable: it is not what was written
            raise Diverged(
                point.seq_id, f"{point.kind} checkpoint", "files", "readable", exc.message
            ) from exc
        _verify(engine, adapter_id, point.seq_id, f"{point.kind} checkpoint", point.state)
        return point
    return None


def _verify(
    engine: EngineAPI, adapter_id: str, seq_id: int, what: str, recorded: Mapping[str, str]
) -> None:
    actual = engine.state_hashes(adapter_id, list(recorded))
    for part, expected in recorded.items():
        if actual[part] != expected:
            raise Diverged(seq_id, what, part, expected, actual[part])


def write_point(
    db: sa.Engine,
    engine: EngineAPI,
    store: ObjectStore,
    session: SessionRow,
    *,
    seq_id: int,
    keep: int,
    hold: Callable[[sa.Connection], object],
) -> auto_checkpoints.AutoCheckpoint:
    """Write an automatic checkpoint of the session's adapter as it stands after `seq_id`,
    record it (under the caller's lease, via `hold(conn)`), and prune the older ones."""
    prefix = auto_checkpoints.storage_prefix(session.tenant_id, session.id, seq_id)
    size = checkpoint_io.write_point(engine, store, session.id, prefix)
    state = engine.state_hashes(session.id)
    point = auto_checkpoints.AutoCheckpoint(
        session.id, seq_id, auto_checkpoints.AUTO, prefix, state, size
    )
    with db.begin() as conn:
        hold(conn)
        auto_checkpoints.record(conn, tenant_id=session.tenant_id, checkpoint=point)
        stale = auto_checkpoints.prune(conn, session.id, keep)
    for old in stale:
        store.delete_prefix(old + "/")
    return point


def rebuild_from_source(
    db: sa.Engine,
    engine: EngineAPI,
    store: ObjectStore,
    p: Rebuild,
    *,
    adapter_id: str,
    interrupt: Interrupt | None,
) -> dict[str, Any]:
    """Build a replay's or fork's adapter from its source's log, verified step by step, and
    report how it went. A replay reports a divergence; a fork that cannot be built exactly
    fails (ConflictError, GoneError) rather than start from weights its source never had."""
    with db.connect() as conn:
        source = sessions_core.get_session(conn, None, p.source_session_id)
    is_replay = p.mode == RebuildMode.REPLAY
    report: dict[str, Any] = {"mode": p.mode, "source_session_id": source.id, "to_seq": p.to_seq}
    try:
        rebuilt = rebuild(
            db, engine, store, source, adapter_id=adapter_id, up_to_seq=p.to_seq,
            snapshots=(),  # the source's samplers keep their own snapshots
            interrupt=interrupt, from_start=is_replay,
        )  # fmt: skip
    except Unrecoverable as exc:
        raise GoneError(
            f"{source.id} cannot be rebuilt up to seq {p.to_seq}: {exc}; pick a seq_id after a "
            "checkpoint whose files are still there"
        ) from exc
    except Diverged as exc:
        if not is_replay:
            raise ConflictError(
                f"{source.id}'s log does not reproduce its state at seq {exc.seq_id} "
                f"({exc.what}: {exc.part} hash {exc.actual} != recorded {exc.expected}), so no "
                f"exact fork at seq {p.to_seq} exists; `treadle replay {source.id}` reports the "
                "first divergence"
            ) from exc
        return {
            **report, "matched": False, "replayed": exc.replayed, "verified": exc.verified,
            "first_divergence": {
                "seq_id": exc.seq_id, "operation": exc.what, "part": exc.part,
                "recorded": exc.expected, "replayed": exc.actual,
            },
        }  # fmt: skip
    return {
        **report, "matched": True, "from_seq": rebuilt.from_seq, "replayed": rebuilt.replayed,
        "verified": rebuilt.verified, "first_divergence": None,
        "seconds": round(rebuilt.seconds, 4),
        "original_seconds": round(rebuilt.original_seconds, 4),
    }  # fmt: skip
