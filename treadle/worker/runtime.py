"""The worker process: a Celery worker (solo pool, prefetch 1, acks_late) hosting sessions.

`run_worker` builds the engine and the session host, starts the metrics server (`gauges`),
registers the wake/stop tasks, starts the lease keeper (heartbeat, claiming unleased sessions,
consuming leased sessions' queues, re-waking stalled operations) and runs Celery until
SIGTERM/SIGINT. Imports platform and the engine; never api.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery
from celery.signals import after_setup_task_logger, worker_ready, worker_shutting_down

from treadle.engine.distributed import group as worker_group
from treadle.engine.distributed.executor import GroupEngine
from treadle.engine.engine import Engine
from treadle.engine.memory import heap
from treadle.engine.memory.capacity import Capacity
from treadle.platform import db, logs
from treadle.platform.checkpoints import checkpoints, storage
from treadle.platform.config import PlatformConfig
from treadle.platform.eventlog import notify
from treadle.platform.models import registry
from treadle.platform.operations import cancellation, operations, recorded_samples
from treadle.platform.sessions import leases, routing
from treadle.platform.sessions import sessions as sessions_core
from treadle.worker import gauges
from treadle.worker.host import SessionHost

log = logging.getLogger(__name__)

# A pending operation this old gets a fresh wake-up (a message lost with a dead worker).
STALL_SECONDS = 3.0


def build_app(config: PlatformConfig, host: SessionHost) -> Celery:
    app = routing.make_celery(config.redis_url)

    @app.task(name=routing.WAKE_TASK)
    def wake(session_id: str, request_id: str | None = None) -> None:
        host.wake(session_id, request_id)

    @app.task(name=routing.STOP_TASK)
    def stop(session_id: str) -> None:
        host.stop(session_id)

    return app


class LeaseKeeper(threading.Thread):
    """Heartbeats the worker, claims sessions no live worker holds, keeps its sessions' queues
    consumed and moving, and interrupts an operation whose session was stopped."""

    def __init__(
        self, config: PlatformConfig, host: SessionHost, app: Celery, metrics_url: str | None = None
    ) -> None:
        super().__init__(name="lease-keeper", daemon=True)
        self.config = config
        # What the heartbeat tells the platform about this process (`treadle status` shows it).
        self.info: dict[str, Any] = {"pid": os.getpid(), "metrics_url": metrics_url}
        shards = 1
        if isinstance(host.engine, GroupEngine):
            group = host.engine.group
            self.info["world_size"] = group.world_size
            self.info["group_timeout_seconds"] = group.timeout_seconds
            self.info["layout"] = group.layout
            shards = group.world_size if group.sharded else 1
        self.host = host
        engine = host.engine
        self.capacity = Capacity(
            engine.device, engine.dtype, config.worker_model_memory_bytes, shards=shards
        )
        self.app = app
        self.consuming: set[str] = set()
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._first = True
        host.on_not_holder = self.hand_off

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("lease keeper tick failed; retrying")
            self.stopped.wait(self.config.worker_heartbeat_seconds)

    def tick(self) -> None:
        me = self.host.worker_id
        if isinstance(self.host.engine, GroupEngine):
            self.host.engine.ping()  # a dead rank ends the group here, between operations
        with self.host.db.begin() as conn:
            # Retired models too: the sessions already on them still need a host.
            models = [m.info for m in registry.list_models(conn, include_retired=True)]
            report = self.capacity.report(models)
            leases.heartbeat_worker(conn, me, {**self.info, **report})
            hostable = report["models"]
            ttl = self.config.lease_ttl_seconds
            claimed = [
                s
                for s in leases.unleased_sessions(conn, base_models=hostable)
                if leases.lease_session(conn, s, me, only_if_unleased=True)
            ] + [
                s
                for s in leases.orphaned_sessions(conn, ttl, base_models=hostable)
                if leases.lease_session(conn, s, me, only_if_unleased=False)
            ]
            mine = leases.sessions_leased_to(conn, me)
            stalled = operations.stale_pending(conn, mine, STALL_SECONDS)
            expired = checkpoints.reap_expired(conn)
            recorded_samples.purge_expired(conn)
            idle = self.config.session_idle_seconds
            failed = [
                request_id
                for session_id in (sessions_core.expire_idle(conn, idle) if idle > 0 else [])
                for request_id in cancellation.fail_pending(
                    conn,
                    session_id,
                    sessions_core.expired_message(session_id, idle),
                    code="session_expired",
                )
            ]
        for request_id in failed:
            notify.publish_done(self.host.redis, request_id)
        self.interrupt_if_stopped()
        self.host.forget_all_but(set(mine))
        for checkpoint in expired:
            self.host.store.delete_prefix(checkpoint.storage_prefix + "/")
            log.info("deleted expired checkpoint %s", checkpoint.path)
        with self._lock:
            for session_id in mine:
                if session_id not in self.consuming:
                    routing.start_consuming(self.app, me, session_id)
                    self.consuming.add(session_id)
            for session_id in self.consuming - set(mine):
                routing.stop_consuming(self.app, me, session_id)
                self.consuming.discard(session_id)
        # A session that just came here is rebuilt at once, not when its next operation comes.
        woken = set(mine if self._first else claimed)
        self._first = False
        for session_id in woken:
            routing.wake(self.app, session_id, None)
        for session_id, request_id in stalled:
            if session_id not in woken:
                routing.wake(self.app, session_id, request_id)
                woken.add(session_id)

    def interrupt_if_stopped(self) -> None:
        """Stop the running operation (or each sample of the running batch) at its next step
        if its session was stopped meanwhile."""
        op = self.host.running()
        for running in ([] if op is None else [op]) + self.host.running_samples():
            with self.host.db.connect() as conn:
                session = sessions_core.get_session(conn, None, running.session_id)
                current = operations.get_operation(conn, None, running.request_id)
            if not session.is_active or current.is_done:
                self.host.cancel(
                    running.request_id,
                    f"{running.type} was cancelled: model {running.session_id} was stopped",
                )

    def hand_off(self, session_id: str, request_id: str | None) -> None:
        """A wake-up for a session this worker no longer holds: stop consuming its queue now
        and send the wake-up on, so the holder gets it."""
        with self._lock:
            if session_id in self.consuming:
                routing.stop_consuming(self.app, self.host.worker_id, session_id)
                self.consuming.discard(session_id)
        routing.wake(self.app, session_id, request_id)


def new_engine(
    config: PlatformConfig,
    database: sa.Engine,
    *,
    spill_dir: Path,
    group: worker_group.Group | None = None,
    device: str | None = None,
    pack_cpu_weights: bool | None = None,
) -> Engine:
    """The engine of a worker (or of one rank of a group) as `config` says, reading registered
    models through `database`; `device` and `pack_cpu_weights` override the configured ones."""
    return Engine(
        cache_dir=config.cache_dir,
        device=device or config.device,
        max_loaded_adapters=config.max_loaded_adapters or None,  # 0: no limit
        max_loaded_snapshots=config.max_loaded_snapshots or None,
        spill_dir=spill_dir,
        pack_cpu_weights=config.pack_cpu_weights if pack_cpu_weights is None else pack_cpu_weights,
        activation_checkpointing=config.activation_checkpointing,
        models=registry.ModelRegistry(database).get,
        group=group,
        microbatch_tokens=config.microbatch_tokens or None,
    )


def run_worker(
    config: PlatformConfig,
    worker_id: str,
    *,
    loglevel: str = "INFO",
    group: worker_group.Group | None = None,
) -> None:
    """Run the worker `worker_id` until it is shut down: alone, or as rank 0 of `group`, whose
    other ranks follow its engine (`worker/launch.py`)."""
    heap.keep_freed_pages()
    database = db.connect(config.database_url, pool_size=4)
    engine: Engine | GroupEngine = new_engine(
        config, database, spill_dir=config.spill_dir(worker_id), group=group
    )
    if group is not None:
        engine = GroupEngine(engine, group)
    host = SessionHost(
        db=database,
        redis_client=redis.Redis.from_url(config.redis_url),
        engine=engine,
        store=storage.store_from_config(config),
        worker_id=worker_id,
        config=config,
    )
    # A new process never shares a lease epoch with an earlier one of the same id: whatever
    # that one held is released (and claimed again with a new epoch).
    with host.db.begin() as conn:
        released = leases.retire_worker(conn, worker_id, "the worker restarted")
    if released:
        log.info("%s: released %d lease(s) of a previous run", worker_id, len(released))
    metrics_url = gauges.serve(config, host)
    app = build_app(config, host)
    keeper = LeaseKeeper(config, host, app, metrics_url)
    # Start keeping leases once the consumer is connected, so its add_consumer requests land.
    worker_ready.connect(lambda **_: keeper.start(), weak=False)
    # SIGTERM: interrupt the running operation at its next step (it stays pending for the next
    # holder) instead of waiting for it to finish.
    worker_shutting_down.connect(lambda **_: host.close(), weak=False)
    # Celery's task logger gets a plain-text handler of its own: its records go through the
    # root handler (platform/logs) instead, so every line of the worker is in one format.
    after_setup_task_logger.connect(logs.to_root, weak=False)
    # Celery prints its banner straight to stdout, past logging: left out of a JSON log (its
    # connection and readiness are records of their own).
    quiet = ["--quiet"] if config.log_format == "json" else []
    # Celery writes a line for every task it receives and every one that succeeds: two per
    # operation (its wake-up), on the operation's path, saying less than the operation's own
    # record (platform/oplog). Below DEBUG they are left out; a task that fails is still logged,
    # at ERROR.
    if logging.getLevelName(loglevel.upper()) != logging.DEBUG:
        for name in ("celery.worker.strategy", "celery.app.trace"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        app.worker_main(
            [
                *quiet,
                "worker",
                "--pool=solo",
                "--concurrency=1",
                f"--hostname={worker_id}",
                f"--queues={routing.DEFAULT_QUEUE}",
                f"--loglevel={loglevel}",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        )
    finally:
        host.close()
        keeper.stopped.set()
        keeper.join(timeout=10)
        if isinstance(engine, GroupEngine):
            engine.close()  # the other ranks stop following
            worker_group.leave(engine)
        with host.db.begin() as conn:
            released = leases.retire_worker(conn, worker_id, "the worker shut down")
        log.info("%s: released %d session lease(s) on shutdown", worker_id, len(released))
