"""The worker process: a Celery worker (solo pool, prefetch 1, acks_late) hosting sessions.

`run_worker` builds the engine and the session host, registers the wake/stop tasks, starts the
lease keeper (heartbeat, claiming unleased sessions, consuming leased sessions' queues, re-waking
stalled operations) and runs Celery until SIGTERM/SIGINT. Imports platform and the engine; never api.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading

import redis
from celery import Celery
from celery.signals import worker_ready

from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.host import SessionHost
from treadle.platform import checkpoints, db, operations, routing, storage
from treadle.platform import sessions as sessions_core
from treadle.platform.config import PlatformConfig

log = logging.getLogger(__name__)

STALL_SECONDS = 3.0


def default_worker_id(config: PlatformConfig, index: int = 0) -> str:
    """Stable across restarts of one platform, distinct between platforms sharing a broker."""
    platform = hashlib.sha256(config.database_url.encode()).hexdigest()[:8]
    return f"w{index}.{platform}@{socket.gethostname()}"


def build_app(config: PlatformConfig, host: SessionHost) -> Celery:
    app = routing.make_celery(config.redis_url)

    @app.task(name=routing.WAKE_TASK)
    def wake(session_id: str, request_id: str) -> None:
        host.wake(session_id, request_id)

    @app.task(name=routing.STOP_TASK)
    def stop(session_id: str) -> None:
        host.stop(session_id)

    return app


class LeaseKeeper(threading.Thread):
    """Heartbeats the worker and keeps its leased sessions' queues consumed and moving."""

    def __init__(self, config: PlatformConfig, host: SessionHost, app: Celery) -> None:
        super().__init__(name="lease-keeper", daemon=True)
        self.config = config
        self.host = host
        self.app = app
        self.consuming: set[str] = set()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("lease keeper tick failed; retrying")
            self.stopped.wait(self.config.worker_heartbeat_seconds)

    def tick(self) -> None:
        me = self.host.worker_id
        with self.host.db.begin() as conn:
            sessions_core.heartbeat_worker(conn, me, {"pid": os.getpid()})
            for session_id in sessions_core.unleased_sessions(conn):
                sessions_core.lease_session(conn, session_id, me, only_if_unleased=True)
            for session_id in sessions_core.orphaned_sessions(conn, self.config.lease_ttl_seconds):
                sessions_core.lease_session(conn, session_id, me, only_if_unleased=False)
            mine = sessions_core.sessions_leased_to(conn, me)
            stalled = operations.stale_pending(conn, mine, STALL_SECONDS)
            expired = checkpoints.reap_expired(conn)
        for checkpoint in expired:
            self.host.store.delete_prefix(checkpoint.storage_prefix + "/")
            log.info("deleted expired checkpoint %s", checkpoint.path)
        for session_id in mine:
            if session_id not in self.consuming:
                routing.start_consuming(self.app, me, session_id)
                self.consuming.add(session_id)
        for session_id in self.consuming - set(mine):
            routing.stop_consuming(self.app, me, session_id)
            self.consuming.discard(session_id)
        woken: set[str] = set()
        for session_id, request_id in stalled:
            if session_id not in woken:
                routing.wake(self.app, session_id, request_id)
                woken.add(session_id)


def run_worker(config: PlatformConfig, worker_id: str, *, loglevel: str = "INFO") -> None:
    engine = Engine(cache_dir=config.cache_dir, device=config.device)
    host = SessionHost(
        db=db.connect(config.database_url, pool_size=4),
        redis_client=redis.Redis.from_url(config.redis_url),
        engine=engine,
        store=storage.store_from_config(config),
        worker_id=worker_id,
    )
    app = build_app(config, host)
    keeper = LeaseKeeper(config, host, app)
    # Start keeping leases once the consumer is connected, so its add_consumer requests land.
    worker_ready.connect(lambda **_: keeper.start(), weak=False)
    try:
        app.worker_main(
            [
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
        keeper.stopped.set()
        keeper.join(timeout=10)
        with host.db.begin() as conn:
            released = sessions_core.release_leases(conn, worker_id)
        log.info("%s: released %d session lease(s) on shutdown", worker_id, len(released))
