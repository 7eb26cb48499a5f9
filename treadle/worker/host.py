"""The session host: runs each leased session's operations on the engine, strictly in order.

A wake-up names a session (and maybe a request); the host reads the log and applies the
session's next training operations in seq_id order (a duplicate is dropped; a seq_id refused at
admission is passed over at once; any other gap waits for its request, or is skipped once it has
waited the gap timeout), hands samples to one continuous engine batch across its sessions
(`sample_batches`), and settles each outcome in one transaction guarded by its lease epoch
(`settle`).

What the host holds in memory is trusted only for the lease epoch and applied seq_id it was built
for: anything else is rebuilt from the newest automatic checkpoint and a verified replay
(`recovery`), and an operation's effect counts only once its own settlement commits it as
completed; otherwise the adapter is discarded and rebuilt. A replay that does not reproduce the
recorded state marks the session diverged. Every operation runs under an interrupt (`running`)
that stops it at its next step boundary when its session is stopped, the worker shuts down or the
execution time limit passes. Imports platform and the engine; never api.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import sqlalchemy as sa

from treadle.engine import EngineAPI
from treadle.platform import db
from treadle.platform.audit.mlflow_publisher import MlflowPublisher
from treadle.platform.checkpoints.storage import ObjectStore
from treadle.platform.config import PlatformConfig
from treadle.platform.eventlog import events, notify
from treadle.platform.eventlog.optypes import (
    ForwardBackward,
    OptimStep,
    Payload,
    Rebuild,
    Sample,
    parse_payload,
)
from treadle.platform.operations import cancellation, operations
from treadle.platform.sessions import leases
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.sessions.sessions import ADAPTER_KINDS, SessionRow, SessionStatus
from treadle.worker import faults, handlers, recovery
from treadle.worker.running import Running, WorkerClosing, error_of
from treadle.worker.sample_batches import SampleBatches
from treadle.worker.sampler_thread import SamplerThread
from treadle.worker.settle import Settler

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """What the adapter in memory was built for: valid only while both still hold."""

    epoch: int
    applied_seq: int
    steps_since_point: int  # optimizer steps since the last recovery point


class SessionHost:
    def __init__(
        self,
        *,
        db: sa.Engine,
        redis_client: redis.Redis,
        engine: EngineAPI,
        store: ObjectStore,
        worker_id: str,
        config: PlatformConfig,
    ) -> None:
        self.db = db
        self.store = store
        self.redis = redis_client
        self.engine = engine
        self.worker_id = worker_id
        self.config = config
        self.closing = threading.Event()
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._held: dict[str, _Held] = {}
        self._running: Running | None = None
        self._waking = 0  # wake-ups running now (`busy`); changed under `_waking_lock`
        self._waking_lock = threading.Lock()
        self.publisher = (
            MlflowPublisher(db, config.mlflow_tracking_uri, config.mlflow_experiment)
            if config.mlflow_tracking_uri
            else None
        )
        self.settler = Settler(
            db, redis_client, worker_id, config.metering,
            step_settled=self.publisher.step_settled if self.publisher else None,
        )  # fmt: skip
        self.samples = SampleBatches(self)
        # samples beside training (vLLM) run on a thread of their own; else on the Celery
        # thread, between a training operation's passes
        self.sampler = SamplerThread(self) if self.samples.beside else None
        self.on_not_holder: Any = None  # set by the runtime: stop consuming a lost session

    # --- entry points (Celery tasks, the lease keeper) ---------------------------------------

    def wake(self, session_id: str, request_id: str | None) -> None:
        """Run what the session has pending (`request_id`: a sample to run now)."""
        if self.closing.is_set():
            return
        with self._waking_lock:
            self._waking += 1
        try:
            self._wake(session_id, request_id)
        finally:
            with self._waking_lock:
                self._waking -= 1

    def _wake(self, session_id: str, request_id: str | None) -> None:
        with self._locks[session_id]:
            with db.reading(self.db) as conn:  # one read, no transaction to begin or end
                if request_id is None:
                    session, found = sessions_core.get_session(conn, None, session_id), None
                else:
                    session, found = operations.session_and_operation(conn, session_id, request_id)
            op, payload = found if found is not None else (None, None)
            if session.worker_id != self.worker_id:
                log.info("%s: not the lease holder of %s", self.worker_id, session_id)
                if self.on_not_holder is not None:
                    self.on_not_holder(session_id, request_id)
                return
            if not session.is_active:
                self._let_go(session_id)
                return
            try:
                if op is not None and op.sampler_id is not None:
                    if not op.is_done:
                        self._run_unordered(session, op, parse_payload(op.type, payload))
                    return
                # The operation woken for is usually the one to apply next: no need to look it up.
                next_op = None
                if op is not None and not op.is_done and op.seq_id == session.last_applied_seq + 1:
                    next_op = (op, payload)
                self._drain(session_id, session, next_op)
            except (recovery.Diverged, recovery.Unrecoverable) as exc:
                self._halt(session_id, exc)
            except WorkerClosing:
                log.info(
                    "%s: left %s to its next holder (shutting down)", self.worker_id, session_id
                )

    def lock(self, session_id: str) -> threading.Lock:
        """The lock held while the session's operations run (one thread per session)."""
        return self._locks[session_id]

    def stop(self, session_id: str) -> None:
        with self._locks[session_id]:
            self._let_go(session_id)

    def forget_all_but(self, mine: set[str]) -> None:
        """Free the adapters of sessions this worker no longer hosts (stopped, or leased to
        another worker): they could never be used again without a rebuild anyway. A session
        busy right now is left for the next call."""
        for session_id in list(self._held):
            if session_id in mine:
                continue
            lock = self._locks[session_id]
            if lock.acquire(blocking=False):
                try:
                    self._let_go(session_id)
                finally:
                    lock.release()

    def running(self) -> operations.OperationRow | None:
        run = self._running
        return None if run is None else run.op

    def running_samples(self) -> list[operations.OperationRow]:
        """The sample operations of the batch running now (empty when none)."""
        return self.samples.running_ops()

    def cancel(self, request_id: str, reason: str) -> None:
        """Stop the running operation `request_id` at its next step boundary (any thread)."""
        run = self._running
        if run is not None and run.op.request_id == request_id:
            run.cancelled = reason
        self.samples.cancel(request_id, reason)

    def close(self) -> None:
        """The worker is shutting down: interrupt the running operation, start nothing new."""
        self.closing.set()
        if self.sampler is not None:
            self.sampler.poke()
        if self.publisher is not None:
            self.publisher.close()

    def busy(self) -> bool:
        """Whether a wake-up is running now (an operation, a rebuild: the wake-ups of samples
        wait behind it)."""
        return self._waking > 0

    # --- ordering ---------------------------------------------------------------------------

    def _drain(
        self,
        session_id: str,
        read: SessionRow | None = None,
        pending: tuple[operations.OperationRow, Any] | None = None,
    ) -> None:
        """Apply the session's next training operations in order. `read`: the session as the
        caller read it a moment ago, under this session's lock (spares the first read);
        `pending`: the pending operation at its next seq_id, with its payload, read with it
        (spares the first look-up)."""
        while not self.closing.is_set():
            with db.reading(self.db) as conn:  # reads only: no transaction to begin or end
                session = read or sessions_core.get_session(conn, None, session_id)
                read = None
                if session.worker_id != self.worker_id or not session.is_active:
                    return
                op: operations.OperationRow | None
                if pending is not None:
                    (op, payload), later = pending, False
                    pending = None
                else:
                    next_seq = session.last_applied_seq + 1
                    op, payload, later = _training_op_at(conn, session_id, next_seq)
                oldest = None
                if later:  # a gap before it: how long has it waited?
                    oldest = operations.oldest_pending_training_op(conn, session_id)
            if op is None:
                if oldest is None or oldest[1] < self.config.gap_timeout_seconds:
                    self._ensure_current(session)  # rebuild now, not when the next op comes
                    return  # nothing to do, or the missing request may still arrive
                self._skip(session, oldest[0], "never received; later operations went ahead")
                continue
            if op.is_done:  # settled by a previous holder; cannot happen with a current lease
                return
            self._ensure_current(session)
            if not self._execute(session, op, parse_payload(op.type, payload)):
                return  # nothing was pending after it; anything admitted since has its wake-up

    def _skip(self, session: SessionRow, to_seq: int, reason: str) -> None:
        with self.db.begin() as conn:
            moved = operations.skip_gap(
                conn, session.id, self.worker_id, session.lease_epoch, to_seq, reason
            )
            after = sessions_core.get_session(conn, None, session.id).last_applied_seq
        held = self._held.get(session.id)
        if moved and held is not None and held.applied_seq == session.last_applied_seq:
            held.applied_seq = after  # nothing was applied: what is held stays valid
        log.info(
            "%s: skipped seq %d..%d (%s)", session.id, session.last_applied_seq + 1, after, reason
        )

    # --- what is held -----------------------------------------------------------------------

    def _ensure_current(self, session: SessionRow) -> None:
        """Make the adapter in memory match the session's log at its current lease."""
        if session.kind not in ADAPTER_KINDS:
            return
        held = self._held.get(session.id)
        if (
            held is not None
            and held.epoch == session.lease_epoch
            and held.applied_seq == session.last_applied_seq
            and (self.engine.has_adapter(session.id) or session.last_applied_seq < 0)
        ):
            return
        self._discard(session.id)
        if session.last_applied_seq < 0:  # nothing applied yet: seq 0 creates the adapter
            self._held[session.id] = _Held(session.lease_epoch, -1, 0)
            return
        rebuilt = recovery.recover(
            self.db,
            self.engine,
            self.store,
            session,
            adapter_id=session.id,
            up_to_seq=session.last_applied_seq,
            interrupt=self.closing_interrupt,
        )
        self._held[session.id] = _Held(
            session.lease_epoch, session.last_applied_seq, rebuilt.optim_steps_since_point
        )
        with self.db.begin() as conn:
            leases.hold(conn, session.id, self.worker_id, session.lease_epoch)
            events.append(
                conn,
                session.id,
                session.tenant_id,
                "SessionRecovered",
                {
                    "worker_id": self.worker_id,
                    "epoch": session.lease_epoch,
                    "from_seq": rebuilt.from_seq,
                    "to_seq": rebuilt.to_seq,
                    "replayed": rebuilt.replayed,
                    "seconds": round(rebuilt.seconds, 3),
                },
            )
        log.info(
            "%s: rebuilt %s from seq %d to %d, %d operations replayed and verified in %.2f s",
            self.worker_id, session.id, rebuilt.from_seq, rebuilt.to_seq, rebuilt.replayed,
            rebuilt.seconds,
        )  # fmt: skip

    def _discard(self, session_id: str) -> None:
        """Forget the session's adapter and its samplers' snapshots: rebuild before next use."""
        self._held.pop(session_id, None)
        if self.engine.has_adapter(session_id):
            self.engine.drop_adapter(session_id)

    def _let_go(self, session_id: str) -> None:
        """The session is not this worker's to run any more (stopped, ended, leased elsewhere):
        forget it, and let the MLflow publisher end its run if the session has ended."""
        self._discard(session_id)
        if self.publisher is not None:
            self.publisher.session_left(session_id)

    def closing_interrupt(self) -> None:
        if self.closing.is_set():
            raise WorkerClosing

    # --- execution --------------------------------------------------------------------------

    def _execute(self, session: SessionRow, op: operations.OperationRow, payload: Payload) -> bool:
        """Run and settle a training operation; False when its settlement saw no training
        operation of the session pending after it (the drain has nothing more to look up)."""
        call = self.call(session, op)
        started_at = time.time()
        outcome, error, state, seconds = self._run(call, payload, op)
        try:
            if self.config.debug_faults:
                faults.maybe_pause(self.redis, session.id, op.type, op.seq_id, self.closing)
            settlement = self.settler.settle(
                session, op, outcome, error, state, seconds, started_at
            )
        except BaseException:
            self._discard(session.id)  # whether it committed is unknown: rebuild from the log
            if self.config.debug_faults:
                faults.note_settle_failure(self.redis, session.id, op.seq_id)
            raise
        settled = settlement is not None and settlement.is_new
        if not (settled and error is None):
            self._discard(session.id)  # its effect, if any, is not in the log
            if settled and isinstance(payload, Rebuild):  # a replay or fork that never began
                assert error is not None
                self._halt(session.id, recovery.Unrecoverable(error["message"]))
            return True
        more = settlement is not None and settlement.next_pending is not None
        held = self._held.get(session.id)
        if held is None:
            return more
        held.applied_seq = op.seq_id
        if outcome is not None and outcome.point is not None:
            held.steps_since_point = 0
        if isinstance(payload, OptimStep):
            held.steps_since_point += 1
            every = self.config.auto_checkpoint_steps
            if every > 0 and held.steps_since_point >= every:
                self._write_point(session, op.seq_id)
        return more

    def _run_unordered(
        self, session: SessionRow, op: operations.OperationRow, payload: Payload
    ) -> None:
        """A sampler's operation: a sample joins a batch (on the sampling thread, when there is
        one: its snapshot made here, under its session's lock); anything else runs alone, now."""
        if isinstance(payload, Sample):
            if payload.snapshot_id and not payload.checkpoint_prefix:
                self.ensure_snapshot(session, payload.snapshot_id)
            if self.sampler is None:
                self.samples.run(session, op, payload)
            else:
                self.samples.woken.add(op.request_id)
                self.sampler.poke()
            return
        outcome, error, _, seconds = self._run(self.call(session, op), payload, op)
        self.settler.settle(session, op, outcome, error, None, seconds, time.time() - seconds)

    def call(self, session: SessionRow, op: operations.OperationRow) -> handlers.Call:
        return handlers.Call(
            engine=self.engine,
            store=self.store,
            tenant_id=session.tenant_id,
            session_id=session.id,
            base_model=session.base_model,
            adapter_id=session.id,
            seq_id=op.seq_id,
            live=True,
            rebuild=self._rebuild_from_source,
        )

    def _rebuild_from_source(self, call: handlers.Call, p: Rebuild) -> dict[str, Any]:
        run = self._running
        return recovery.rebuild_from_source(
            self.db, self.engine, self.store, p, adapter_id=call.adapter_id,
            interrupt=None if run is None else run.check_stop,
        )  # fmt: skip

    def _run(
        self, call: handlers.Call, payload: Payload, op: operations.OperationRow
    ) -> tuple[handlers.Outcome | None, dict[str, Any] | None, dict[str, str] | None, float]:
        """Run the payload under an interrupt; (outcome, error, state hashes, seconds)."""
        run = Running(self.closing, op, self.config.op_time_limit_seconds)
        self._running = run
        started = time.perf_counter()
        outcome = error = state = None
        try:
            interrupt = run.check
            if (
                isinstance(payload, ForwardBackward)
                and self.engine.topology() is None
                and self.sampler is None
            ):
                interrupt = self._between_passes(run, call.session_id)
            if self.config.debug_faults and isinstance(payload, ForwardBackward):
                interrupt = self._pause_in_passes(interrupt, call.session_id, op.seq_id)
            call = dataclasses.replace(call, interrupt=interrupt)
            outcome = handlers.run(call, payload)
            if payload.changes_state:
                state = self.engine.state_hashes(call.adapter_id, payload.state_parts)
        except (WorkerClosing, KeyboardInterrupt, SystemExit):
            if payload.is_ordered:
                self._discard(call.session_id)  # part of it may have run: not in the log
            raise
        except Exception as exc:  # the engine failed: report it, keep the session going
            error = error_of(exc, f"{call.session_id}: {op.type} seq {op.seq_id} failed")
        finally:
            self._running = None
        return outcome, error, state, time.perf_counter() - started

    def _between_passes(self, run: Running, session_id: str) -> Callable[[], None]:
        """The interrupt of a training operation's passes: `run`'s, then the samples waiting on
        this worker, run to the end, so that a sample waits for one pass, not the whole
        operation (a group's ranks run their passes together: only a worker alone does this).
        The passes are unchanged: a sample touches no adapter's weights or grads."""
        holding = None

        def interrupt() -> None:
            nonlocal holding
            run.check()
            if holding is None:
                with db.reading(self.db) as conn:
                    holding = sessions_core.get_session(conn, None, session_id)
            while self.samples.run_waiting(holding):
                run.check()

        return interrupt

    def _pause_in_passes(
        self, interrupt: Callable[[], None], session_id: str, seq_id: int
    ) -> Callable[[], None]:
        """Fault tests: the interrupt of a forward_backward's passes, paused first when a pause
        is armed for `faults.IN_PASSES` (held inside the engine's training call)."""

        def paused() -> None:
            faults.maybe_pause(self.redis, session_id, faults.IN_PASSES, seq_id, self.closing)
            interrupt()

        return paused

    # --- samplers' snapshots and recovery points ----------------------------------------------

    def ensure_snapshot(self, session: SessionRow, snapshot_id: str) -> None:
        """An ephemeral sampler's snapshot, rebuilt from the log if this process lacks it."""
        if self.engine.has_snapshot(snapshot_id):
            return
        self._ensure_current(session)  # a rebuild re-creates snapshots after its checkpoint
        if self.engine.has_snapshot(snapshot_id):
            return
        with self.db.connect() as conn:
            seq_id = operations.snapshot_seq(conn, session.id, snapshot_id)
        if seq_id is None:
            return  # the engine answers with a clear not-found error
        scratch = f"{session.id}#snapshot"
        recovery.rebuild(
            self.db,
            self.engine,
            self.store,
            session,
            adapter_id=scratch,
            up_to_seq=seq_id,
            snapshots={snapshot_id},
            interrupt=self.closing_interrupt,
        )
        self.engine.drop_adapter(scratch, keep_snapshots=True)

    def _write_point(self, session: SessionRow, seq_id: int) -> None:
        try:
            point = recovery.write_point(
                self.db,
                self.engine,
                self.store,
                session,
                seq_id=seq_id,
                keep=max(1, self.config.auto_checkpoint_keep),
                hold=lambda conn: leases.hold(
                    conn, session.id, self.worker_id, session.lease_epoch
                ),
            )
        except Exception:  # recovery replays further back instead; never fail the session
            log.exception("%s: automatic checkpoint at seq %d failed", session.id, seq_id)
            return
        if (held := self._held.get(session.id)) is not None:
            held.steps_since_point = 0
        log.info(
            "%s: automatic checkpoint at seq %d (%d bytes)", session.id, seq_id, point.size_bytes
        )

    def _halt(self, session_id: str, exc: Exception) -> None:
        """Diverged or unrecoverable: stop the session and fail what waits on it."""
        self._discard(session_id)
        if isinstance(exc, recovery.Diverged):
            status = SessionStatus.DIVERGED
            data: dict[str, Any] = {
                "seq_id": exc.seq_id, "operation": exc.what, "part": exc.part,
                "recorded": exc.expected, "replayed": exc.actual,
            }  # fmt: skip
            message = (
                f"model {session_id} diverged from its log: replaying seq {exc.seq_id} "
                f"({exc.what}) did not reproduce the recorded {exc.part} state, so its weights "
                "can no longer be trusted; start a new session from a saved checkpoint"
            )
            code = "session_diverged"
        else:
            status, data = SessionStatus.FAILED, {"reason": str(exc)}
            message = f"model {session_id} cannot be recovered: {exc}"
            code = "session_failed"
        log.error("%s: %s", session_id, message)
        with self.db.begin() as conn:
            session = sessions_core.get_session(conn, None, session_id, for_update=True)
            if session.worker_id != self.worker_id or not session.is_active:
                return
            sessions_core.halt_session(conn, session, status, {**data, "message": message})
            failed = cancellation.fail_pending(
                conn, session_id, message, code=code, category="server"
            )
        for request_id in failed:
            notify.publish_done(self.redis, request_id)
        if self.publisher is not None:
            self.publisher.session_left(session_id)  # its run ends FAILED


def _training_op_at(
    conn: sa.Connection, session_id: str, next_seq: int
) -> tuple[operations.OperationRow | None, Any, bool]:
    """(operation, its request's payload, later) for the session's training operation to apply
    next: the one at `next_seq`, or the one after a run of seq_ids refused at admission starting
    there (those are passed over). When it has not arrived: (None, None, whether a later one has,
    i.e. whether there is a gap). One query when it is there, or when nothing is."""
    found = operations.training_op_from(conn, session_id, next_seq)
    if found is None:
        return None, None, False
    if found[0].seq_id == next_seq:
        return found[0], found[1], False
    refused_to = operations.refused_run(conn, session_id, next_seq)
    if refused_to >= next_seq and found[0].seq_id == refused_to + 1:
        return found[0], found[1], False
    return None, None, True
