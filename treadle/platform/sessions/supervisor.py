"""Supervision for `treadle up`: what it started keeps running.

Owns the worker child processes: started here, and when one exits (any code, kill -9 included)
retired at once — its heartbeat row deleted and its leases released in one transaction, so live
workers claim its sessions — then restarted under the same worker id with exponential backoff.
Restarts the embedded PostgreSQL / Redis that `treadle up` started, on the same data dir and
port or socket, so every URL already handed out stays valid. Writes `<data dir>/up.json` (what
runs, with pids and restart counts) after every change.
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa

from treadle.platform import db
from treadle.platform.config import PlatformConfig
from treadle.platform.sessions import leases

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
STATE_FILE = "up.json"
# Retiring a dead worker must not hang the loop (and with it the other restarts) on a database
# that does not answer; the next poll tries again.
CONNECT_TIMEOUT_SECONDS = 3


def default_worker_id(config: PlatformConfig, index: int = 0) -> str:
    """Stable across restarts of one platform, distinct between platforms sharing a broker.

    The same id `treadle worker --index i` picks by default; here so that `treadle up` (which
    never imports the worker package and its torch) can name its workers.
    """
    platform = hashlib.sha256(config.database_url.encode()).hexdigest()[:8]
    return f"w{index}.{platform}@{socket.gethostname()}"


class Service(Protocol):
    """An embedded server the supervisor restarts (EmbeddedPostgres, EmbeddedRedis)."""

    @property
    def pid(self) -> int | None: ...

    def is_running(self) -> bool: ...

    def restart(self) -> None: ...


@dataclass
class Backoff:
    """Delays between restarts: 1 s, 2 s, 4 s ... up to 30 s; back to 1 s after a long run."""

    first: float = 1.0
    cap: float = 30.0
    reset_after: float = 60.0
    _next: float = 0.0

    def delay(self, lived: float) -> float:
        """The wait before the next start, for a process that ran `lived` seconds."""
        if not self._next or lived >= self.reset_after:
            self._next = self.first
        delay, self._next = self._next, min(self._next * 2, self.cap)
        return delay


@dataclass
class WorkerProcess:
    """One `treadle worker` child: how to start it, and its current process."""

    worker_id: str
    index: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    backoff: Backoff = field(default_factory=Backoff)
    started_at: float = 0.0
    # Why it exited, while its retirement is still to be done (the database may be down).
    unretired: str | None = None
    retire_failures: int = 0
    restart_at: float = 0.0
    last_pid: int | None = None

    def spawn(self) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        self.started_at = time.monotonic()
        self.last_pid = self.proc.pid


@dataclass
class WatchedService:
    name: str
    service: Service
    restarts: int = 0
    backoff: Backoff = field(default_factory=Backoff)
    down_since: float | None = None
    retry_at: float = 0.0


class Supervisor:
    """Polls every `poll_seconds` in a daemon thread; `shutdown()` stops it, then the workers.

    `start_workers()` (before `start()`) starts the workers; the state file is written by
    `write_state()`, which the caller invokes once it is ready and the loop after every change.
    """

    def __init__(
        self,
        *,
        workers: list[WorkerProcess],
        services: dict[str, Service],
        state_path: Path,
        api_url: str,
        database_url: str,
        redis_url: str,
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        self.workers = workers
        self.services = [WatchedService(name, svc) for name, svc in services.items()]
        self.state_path = state_path
        self.api_url = api_url
        self.database_url = database_url
        self.redis_url = redis_url
        self.poll_seconds = poll_seconds
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._engine: sa.Engine | None = None
        self._state_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    def start_workers(self) -> None:
        for worker in self.workers:
            worker.spawn()
            log.info("started worker %s (pid %d)", worker.worker_id, worker.last_pid)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def stop_supervising(self) -> None:
        """Restart nothing from now on. Only sets a flag: safe in a signal handler."""
        self._stopping.set()

    def shutdown(self, grace: float = 30.0) -> None:
        """Stop supervising first (nothing is restarted during shutdown), then terminate the
        workers, which release their leases themselves; one still running after `grace` is
        killed and retired here."""
        self.stop_supervising()
        if self._thread is not None:
            self._thread.join()
        running = [w for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for worker in running:
            assert worker.proc is not None
            worker.proc.terminate()
        deadline = time.monotonic() + grace
        for worker in running:
            assert worker.proc is not None
            try:
                worker.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "worker %s did not stop within %.0f s; killing it", worker.worker_id, grace
                )
                worker.proc.kill()
                worker.proc.wait()
        for worker in self.workers:
            code = worker.proc.returncode if worker.proc is not None else None
            if code is not None and code < 0:  # killed by a signal: it released nothing itself
                worker.unretired = f"the worker process exited (code {code})"
            if worker.unretired is not None:  # one try: the database may be gone already
                self._retire(worker)
        if self._engine is not None:
            self._engine.dispose()

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_seconds):
            try:
                self.tick()
            except Exception:  # the loop must outlive any one failure
                log.exception("supervisor poll failed; polling on")

    # -- one poll ----------------------------------------------------------------------------

    def tick(self) -> None:
        # Services first: a worker's retirement needs the database.
        changed = False
        for watched in self.services:
            changed |= self._check_service(watched)
        for worker in self.workers:
            changed |= self._check_worker(worker)
        if changed:
            self.write_state()

    def _check_service(self, watched: WatchedService) -> bool:
        if watched.service.is_running():
            return False
        now = time.monotonic()
        if watched.down_since is None:
            log.warning(
                "embedded %s (pid %s) died; restarting it", watched.name, watched.service.pid
            )
            watched.down_since = watched.retry_at = now
        if now < watched.retry_at or self._stopping.is_set():
            return False
        try:
            watched.service.restart()
        except Exception:
            delay = watched.backoff.delay(0)
            log.exception(
                "embedded %s did not restart; trying again in %.0f s", watched.name, delay
            )
            watched.retry_at = time.monotonic() + delay
            return False
        watched.restarts += 1
        watched.backoff = Backoff()
        log.info(
            "embedded %s restarted (pid %s) after %.1f s down",
            watched.name,
            watched.service.pid,
            time.monotonic() - watched.down_since,
        )
        watched.down_since = None
        return True

    def _check_worker(self, worker: WorkerProcess) -> bool:
        if worker.proc is not None:
            code = worker.proc.poll()
            if code is None:
                return False
            now = time.monotonic()
            lived = now - worker.started_at
            worker.proc = None
            worker.unretired = f"the worker process exited (code {code})"
            worker.restart_at = now + worker.backoff.delay(lived)
            log.warning(
                "worker %s (pid %s) exited with code %d after %.1f s; restarting it in %.0f s",
                worker.worker_id,
                worker.last_pid,
                code,
                lived,
                worker.restart_at - now,
            )
        # Retire before restarting: retiring after would delete the new process's heartbeat.
        if worker.unretired is not None and not self._retire(worker):
            return False
        if self._stopping.is_set() or time.monotonic() < worker.restart_at:
            return False
        worker.spawn()
        worker.restarts += 1
        log.info(
            "restarted worker %s (pid %s, restart %d)",
            worker.worker_id,
            worker.last_pid,
            worker.restarts,
        )
        return True

    def _retire(self, worker: WorkerProcess) -> bool:
        """Delete the worker's heartbeat and release its leases in one transaction; False (and
        another try on the next poll) while the database does not answer."""
        assert worker.unretired is not None
        try:
            with self._db().begin() as conn:
                released = leases.retire_worker(conn, worker.worker_id, worker.unretired)
        except sa.exc.SQLAlchemyError as exc:
            worker.retire_failures += 1
            if worker.retire_failures == 1:  # once per outage, not every 0.2 s
                log.warning(
                    "cannot retire worker %s yet (%s); retrying every %.1f s",
                    worker.worker_id,
                    exc.__class__.__name__,
                    self.poll_seconds,
                )
            return False
        log.info(
            "retired worker %s (%s): released %d session lease(s)",
            worker.worker_id,
            worker.unretired,
            len(released),
        )
        worker.unretired = None
        worker.retire_failures = 0
        return True

    def _db(self) -> sa.Engine:
        if self._engine is None:
            url = self.database_url
            if "connect_timeout=" not in url:
                sep = "&" if "?" in url else "?"
                url = f"{url}{sep}connect_timeout={CONNECT_TIMEOUT_SECONDS}"
            self._engine = db.connect(url, pool_size=2)
        return self._engine

    # -- state file --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        services = {w.name: w for w in self.services}

        def service_state(name: str) -> dict[str, Any] | None:
            watched = services.get(name)
            if watched is None:
                return None
            return {"pid": watched.service.pid, "restarts": watched.restarts}

        return {
            "pid": os.getpid(),
            "api_url": self.api_url,
            "database_url": self.database_url,
            "redis_url": self.redis_url,
            "workers": {
                w.worker_id: {"index": w.index, "pid": w.last_pid, "restarts": w.restarts}
                for w in self.workers
            },
            "postgres": service_state("postgres"),
            "redis": service_state("redis"),
            "updated_at": time.time(),
        }

    def write_state(self) -> None:
        """Replace the state file atomically: a reader sees the old file or the new, never half."""
        with self._state_lock:
            tmp = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.state(), indent=2) + "\n")
            os.replace(tmp, self.state_path)
