"""The host's continuous sample batch: samples of this worker's sessions decoded together.

A sample's wake-up starts a batch on its base model (`SampleBatches.run`): the samples that
arrive right after it are gathered before its first step (`SAMPLE_GATHER_*`), more join between
any two decoding steps, as many as the sampler's KV budget has room for (`kv_need` of each
against `sampler_kv_tokens`; the others stay pending until samples leave), until another kind of
operation waits on this worker: then the batch takes no more and ends when its samples are done,
so a stream of samples never starves training. Each sample leaves as soon as it is done and is
settled at once. Each sample runs under its own interrupt (`running.Running`), so
cancelling one stops only it; the streams of those streamed to their clients are written after
every step (`streaming`).

Where the engine's samples run beside training (`EngineAPI.samples_beside_training`: vLLM, in
processes of its own), the batches run on the host's sampling thread (`sampler_thread`) instead,
while the Celery thread trains: they take no session's lock (a sample reads only its snapshot,
which training never changes), keep taking samples whatever else waits, and run only samples
whose snapshots are ready (the Celery thread's wake-up rebuilds one, under its session's lock).
Imports platform and the engine; never api.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Protocol

import redis
import sqlalchemy as sa

from treadle.engine import EngineAPI, Key, SampleBatchAPI, SampleRequest, SampleResult, kv_need
from treadle.platform.config import PlatformConfig
from treadle.platform.eventlog import events, progress
from treadle.platform.eventlog.optypes import OpType, Payload, Sample, parse_payload
from treadle.platform.operations import operations
from treadle.platform.sessions import leases
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.sessions.sessions import SessionRow
from treadle.worker import handlers, streaming
from treadle.worker.running import Running, WorkerClosing, error_of
from treadle.worker.settle import Settler

__all__ = ["BatchHost", "SampleBatches", "sample_kv_need"]

log = logging.getLogger(__name__)

# Samples arriving while a batch runs join it between decoding steps; the database is asked for
# them at most this often.
SAMPLE_LOOK_INTERVAL_SECONDS = 0.02
# A batch gathers the samples that arrive right after its first before its first step: it
# starts once none has come for SAMPLE_GATHER_QUIET_SECONDS (looking every
# SAMPLE_GATHER_LOOK_SECONDS), at the latest SAMPLE_GATHER_MAX_SECONDS after the first.
# Requests sent together reach the worker milliseconds apart: each is admitted on its own, and
# those of one session one after another (each append locks the session's row), 10-15 ms apart
# for 16 requests on one sampler here. On a CPU a decoding step of one row costs nearly what one
# of sixteen does: a batch that started with the first alone decoded it alone for a tenth of a
# second or more, steps every later request then added at its end; a lone sample pays the quiet
# period (docs/benchmarks.md, "Sampling").
SAMPLE_GATHER_QUIET_SECONDS = 0.04
SAMPLE_GATHER_LOOK_SECONDS = 0.01
SAMPLE_GATHER_MAX_SECONDS = 0.3


@dataclasses.dataclass
class _Sampling:
    """A sample operation in the running batch."""

    session: SessionRow
    op: operations.OperationRow
    payload: Sample
    run: Running
    started: float
    kv: int  # the KV tokens it holds at most (`sample_kv_need`)


class BatchHost(Protocol):
    """What a sample batch needs of the session host (`host.SessionHost`)."""

    db: sa.Engine
    redis: redis.Redis
    engine: EngineAPI
    config: PlatformConfig
    worker_id: str
    closing: threading.Event
    settler: Settler

    def lock(self, session_id: str) -> threading.Lock: ...

    def call(self, session: SessionRow, op: operations.OperationRow) -> handlers.Call: ...

    def closing_interrupt(self) -> None: ...


class SampleBatches:
    """The host's sample batches, one running at a time (the Celery pool runs one task)."""

    def __init__(self, host: BatchHost) -> None:
        self.host = host
        self.running: dict[str, Running] = {}  # request id -> each sample of the running batch
        self.beside = host.engine.samples_beside_training()  # see the module's docstring
        # beside training: the samples whose wake-ups made their snapshots if they could; one
        # whose snapshot is still missing then runs, to fail with the engine's not-found error
        self.woken: set[str] = set()

    def running_ops(self) -> list[operations.OperationRow]:
        """The sample operations of the batch running now (empty when none)."""
        return [run.op for run in list(self.running.values())]

    def cancel(self, request_id: str, reason: str) -> None:
        """Stop the sample `request_id` at its next decoding step, if it is in the batch."""
        if (sampling := self.running.get(request_id)) is not None:
            sampling.cancelled = reason

    def run(self, session: SessionRow, first: operations.OperationRow, payload: Payload) -> None:
        """Run `first` (its request's `payload`) in one continuous batch with the samples
        waiting on this worker's sessions; more join between decoding steps while the KV budget
        has room and no other kind of operation waits, and each is settled as soon as it
        finishes (called holding `session`'s lock, or beside training on the sampling thread;
        `first`'s snapshot made, `_ready`)."""
        assert isinstance(payload, Sample)
        batch = self.host.engine.open_batch(session.base_model)
        streams = streaming.Streams(self.host.redis)  # the requests streamed to their clients
        admitted: dict[str, _Sampling] = {}
        with contextlib.ExitStack() as locks:
            try:
                gathered = self._gather(session, (session, first, payload), locks)
                self._admit(batch, gathered, admitted, streams)
                looked = time.monotonic()
                joining_open = True  # until another kind of operation waits on this worker
                while True:
                    now = time.monotonic()
                    if joining_open and (
                        now - looked >= SAMPLE_LOOK_INTERVAL_SECONDS or not len(batch)
                    ):
                        joining, joining_open = self._waiting_samples(
                            session, set(admitted), locks, self._room(admitted)
                        )
                        self._admit(batch, joining, admitted, streams)
                        looked = now
                    if not len(batch):
                        return
                    try:
                        finished = batch.step(self.host.closing_interrupt)
                    except WorkerClosing:
                        raise  # what was cut short stays pending for the next holder
                    except Exception as exc:  # the engine failed: every sample in it fails
                        log.exception("%s: a sample batch failed", self.host.worker_id)
                        finished = [(request_id, exc) for request_id in admitted]
                        self._finish(finished, admitted)
                        return
                    for request_id in streams.after_step(batch, finished):
                        self.cancel(request_id, progress.CANCELLED_MESSAGE)  # at the next step
                    self._finish(finished, admitted)
            finally:
                self.running = {}

    def run_beside(self) -> bool:
        """On the sampling thread, beside training: run the samples waiting on this worker's
        sessions now, in one batch; False when none waits."""
        found = self._first_runnable()
        if found is None:
            return False
        self.run(*found)
        return True

    def run_waiting(self, holding: SessionRow) -> bool:
        """Between two passes of `holding`'s training operation (this thread holds its lock):
        run the samples waiting on this worker's sessions now, in one batch, so that none waits
        for the whole operation; False when none waits (or every one's session is busy)."""
        found = self._first_runnable()
        if found is None:
            return False
        session = found[0]
        # this thread holds the training session's lock; another session's may be busy
        lock = None if session.id == holding.id else self.host.lock(session.id)
        if lock is not None and not lock.acquire(blocking=False):
            return False  # its own thread runs it
        try:
            self.run(*found)
        finally:
            if lock is not None:
                lock.release()
        return True

    def _first_runnable(self) -> tuple[SessionRow, operations.OperationRow, Sample] | None:
        """The first waiting sample (`_first_waiting`) with its session, if this worker holds
        that session and it is active."""
        with self.host.db.connect() as conn:
            found = self._first_waiting(conn)
            if found is None:
                return None
            op, payload = found
            session = sessions_core.get_session(conn, None, op.session_id)
        if session.worker_id != self.host.worker_id or not session.is_active:
            return None
        return session, op, payload

    def _first_waiting(self, conn: sa.Connection) -> tuple[operations.OperationRow, Sample] | None:
        """The first pending sample of this worker's sessions whose weights are ready."""
        mine = leases.sessions_leased_to(conn, self.host.worker_id)
        for request_id in operations.pending_samples(conn, mine):
            op = operations.get_operation(conn, None, request_id)
            if (payload := self._ready(conn, op)) is not None:
                return op, payload
        return None

    def _ready(self, conn: sa.Connection, op: operations.OperationRow) -> Sample | None:
        """The sample `op`'s request, unless its sampler snapshot is still to be rebuilt (its
        own wake-up does that, `SessionHost.ensure_snapshot`)."""
        payload = parse_payload(op.type, events.read_at(conn, op.request_position).data["payload"])
        assert isinstance(payload, Sample)
        snap = payload.snapshot_id
        missing = snap and not payload.checkpoint_prefix and not self.host.engine.has_snapshot(snap)
        if missing and not (self.beside and op.request_id in self.woken):
            return None
        return payload

    def _gather(
        self,
        session: SessionRow,
        first: tuple[SessionRow, operations.OperationRow, Sample],
        locks: contextlib.ExitStack,
    ) -> list[tuple[SessionRow, operations.OperationRow, Sample]]:
        """`first` and the samples that arrive right after it (see SAMPLE_GATHER_*)."""
        gathered = [first]
        room = self.host.config.sampler_kv_tokens - sample_kv_need(first[2])
        started = last = time.monotonic()
        while room > 0 and not self.host.closing.is_set():
            now = time.monotonic()
            if (
                now - last >= SAMPLE_GATHER_QUIET_SECONDS
                or now - started >= SAMPLE_GATHER_MAX_SECONDS
            ):
                break
            time.sleep(SAMPLE_GATHER_LOOK_SECONDS)
            taken = {op.request_id for _, op, _ in gathered}
            more, _ = self._waiting_samples(session, taken, locks, room)
            if more:
                gathered += more
                room -= sum(sample_kv_need(p) for _, _, p in more)
                last = time.monotonic()
        return gathered

    def _room(self, admitted: dict[str, _Sampling]) -> int:
        """The KV tokens of the sampler's budget that the batch's samples do not hold."""
        return self.host.config.sampler_kv_tokens - sum(s.kv for s in admitted.values())

    def _admit(
        self,
        batch: SampleBatchAPI,
        samples: list[tuple[SessionRow, operations.OperationRow, Sample]],
        admitted: dict[str, _Sampling],
        streams: streaming.Streams,
    ) -> None:
        """Let `samples` join `batch`; those that fail before reaching it, or finish at once,
        are settled now."""
        requests: list[tuple[Key, SampleRequest]] = []
        failed: list[tuple[Key, SampleResult | Exception]] = []
        for session, op, payload in samples:
            run = Running(self.host.closing, op, self.host.config.op_time_limit_seconds)
            admitted[op.request_id] = _Sampling(
                session, op, payload, run, time.perf_counter(), sample_kv_need(payload)
            )
            self.running[op.request_id] = run
            call = dataclasses.replace(self.host.call(session, op), interrupt=run.check)
            try:
                requests.append((op.request_id, handlers.sample_request(call, payload)))
            except Exception as exc:  # e.g. a checkpoint sampler whose files are gone
                failed.append((op.request_id, exc))
        if requests:
            log.info(
                "%s: %d samples join a batch of %d", self.host.worker_id, len(requests), len(batch)
            )
        joining = [(op.request_id, payload.num_samples) for _, op, payload in samples]
        for request_id in streams.join(joining):  # cancelled before it ran: stops at its 1st step
            self.cancel(request_id, progress.CANCELLED_MESSAGE)
        finished = failed + batch.add(requests)
        for request_id in streams.after_step(batch, finished):
            self.cancel(request_id, progress.CANCELLED_MESSAGE)
        self._finish(finished, admitted)

    def _finish(
        self, finished: list[tuple[Key, SampleResult | Exception]], admitted: dict[str, _Sampling]
    ) -> None:
        """Settle each finished sample with its result or its error."""
        for key, out in finished:
            if isinstance(out, WorkerClosing):
                raise out  # it stays pending for the next holder
            sampling = admitted.pop(str(key))
            self.running.pop(sampling.op.request_id, None)
            self.woken.discard(sampling.op.request_id)
            outcome, error = None, None
            failed = f"{sampling.session.id}: sample seq {sampling.op.seq_id} failed"
            try:
                if isinstance(out, Exception):
                    raise out
                outcome = handlers.sample_outcome(sampling.payload, out)
            except Exception as exc:
                error = error_of(exc, failed)
            seconds = time.perf_counter() - sampling.started
            started_at = time.time() - seconds  # when it joined its batch, read before settling
            self.host.settler.settle(
                sampling.session, sampling.op, outcome, error, None, seconds, started_at
            )

    def _waiting_samples(
        self,
        session: SessionRow,
        admitted: set[str],
        locks: contextlib.ExitStack,
        room: int,
    ) -> tuple[list[tuple[SessionRow, operations.OperationRow, Sample]], bool]:
        """Other pending samples of this worker's active sessions on the same base model, whose
        weights are ready (a sampler snapshot still to be rebuilt waits for its own wake-up), in
        order, as long as their KV fits in `room` tokens (the first that does not ends the list,
        so that a large sample is not passed over for ever; one larger than the whole budget
        goes in alone, when the batch holds nothing else); takes the lock of each other session it
        includes (skipping a busy one). And whether no other kind of operation waits on this
        worker (False: the batch should take no more; never beside training)."""
        found: list[tuple[SessionRow, operations.OperationRow, Sample]] = []
        budget = self.host.config.sampler_kv_tokens
        only_samples = True
        with self.host.db.connect() as conn:
            mine = leases.sessions_leased_to(conn, self.host.worker_id)
            pending = operations.stale_pending(conn, mine, 0.0)
            sessions: dict[str, SessionRow | None] = {session.id: session}
            for other_session, other_request in pending:
                if other_request in admitted:
                    continue
                op = operations.get_operation(conn, None, other_request)
                if op.is_done:
                    continue
                if op.sampler_id is None or op.type != OpType.SAMPLE:
                    only_samples = False  # e.g. a forward_backward, or a loadWeightsForSampling
                    continue
                if room <= 0:
                    continue  # full: only looking for other kinds of operation now
                if other_session not in sessions:
                    sessions[other_session] = self._joinable(conn, other_session, locks)
                s = sessions[other_session]
                if s is None or s.base_model != session.base_model:
                    continue
                payload = self._ready(conn, op)
                if payload is None:
                    continue
                need = sample_kv_need(payload)
                if need > room and not (need > budget and room == budget):
                    room = 0  # it waits for room: so do those after it
                    continue
                found.append((s, op, payload))
                room -= need
        return found, only_samples or self.beside

    def _joinable(
        self, conn: sa.Connection, session_id: str, locks: contextlib.ExitStack
    ) -> SessionRow | None:
        """The session, locked for the rest of the batch (not beside training), if this worker
        holds it, it is active and no other thread is busy with it."""
        s = sessions_core.get_session(conn, None, session_id)
        if s.worker_id != self.host.worker_id or not s.is_active:
            return None
        if self.beside:
            return s
        lock = self.host.lock(session_id)
        if not lock.acquire(blocking=False):
            return None
        locks.callback(lock.release)
        return s


def sample_kv_need(payload: Sample) -> int:
    """The most tokens of KV cache the sample `payload` holds in a batch (`kv_need`)."""
    return kv_need(len(payload.prompt), payload.num_samples, payload.params.max_tokens)
