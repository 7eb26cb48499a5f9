"""Fault tests: a real `treadle up` (embedded PostgreSQL and Redis, Celery worker processes) whose
processes the tests kill, pause and restart, then compare the final weights with an uninterrupted
run bit for bit.

The platform always runs on its embedded servers (whatever DATABASE_URL / REDIS_URL say), so a
test may kill them, with short heartbeats and lease TTLs so failover takes seconds. `up.json` in
the data dir (written by `treadle up`) names every process and URL.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import sqlalchemy as sa

from treadle.platform import db
from treadle.platform.embedded import free_port

T = TypeVar("T")

# Fast failover for tests: a worker silent for 3 s is dead; an automatic checkpoint every 3
# optimizer steps, so recovery exercises checkpoint + replay within a short loop.
FAULT_ENV = {
    "TREADLE_HEARTBEAT_SECONDS": "0.5",
    "TREADLE_LEASE_TTL_SECONDS": "3",
    "TREADLE_AUTO_CHECKPOINT_STEPS": "3",
    "TREADLE_AUTO_CHECKPOINT_KEEP": "2",
    "TREADLE_LONG_POLL_SECONDS": "5",
    "TREADLE_DEBUG_FAULTS": "1",  # lets a test pause an operation before its settlement
}


def wait_for(check: Callable[[], T | None], timeout: float, what: str, every: float = 0.1) -> T:
    """Poll `check` until it returns something other than None/False; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value is not None and value is not False:
                return value
        except Exception as exc:  # a service that is restarting
            last_error = exc
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} ({last_error!r})")


@dataclass
class Up:
    """A running `treadle up`, its processes and a database connection to it."""

    data_dir: Path
    admin_key: str
    base_url: str
    proc: subprocess.Popen[bytes]
    _db: sa.Engine | None = field(default=None, repr=False)

    def state(self) -> dict[str, Any]:
        return json.loads((self.data_dir / "up.json").read_text())  # type: ignore[no-any-return]

    @property
    def database_url(self) -> str:
        return str(self.state()["database_url"])

    @property
    def redis_url(self) -> str:
        return str(self.state()["redis_url"])

    @property
    def db(self) -> sa.Engine:
        if self._db is None:
            self._db = db.connect(self.database_url, pool_size=2)
        return self._db

    def worker_pids(self) -> dict[str, int]:
        return {wid: int(w["pid"]) for wid, w in self.state()["workers"].items()}

    def holder(self, model_id: str) -> tuple[str, int]:
        """(worker id, lease epoch) of a session."""
        with self.db.connect() as conn:
            row = conn.execute(
                sa.text("SELECT worker_id, lease_epoch FROM sessions WHERE id = :id"),
                {"id": model_id},
            ).one()
        return row.worker_id, row.lease_epoch

    def holder_pid(self, model_id: str) -> int:
        worker_id = wait_for(lambda: self.holder(model_id)[0], 30, f"a holder of {model_id}")
        return self.worker_pids()[worker_id]

    def events(self, model_id: str, *types: str) -> list[dict[str, Any]]:
        with self.db.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT type, data FROM events WHERE session_id = :id ORDER BY seq"),
                {"id": model_id},
            ).all()
        return [{"type": r.type, **r.data} for r in rows if not types or r.type in types]

    def live_workers(self) -> int:
        with self.db.connect() as conn:
            return int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM workers "
                        "WHERE heartbeat_at > now() - interval '3 seconds'"
                    )
                ).scalar_one()
            )

    def wait_ready(self, workers: int, timeout: float = 180) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError("treadle up exited:\n" + self.log())
            if not (self.data_dir / "up.json").exists():
                return False
            health = httpx.get(f"{self.base_url}/healthz", timeout=2).status_code
            # with no worker of its own, the platform answers 503 until one joins from outside
            if health != 200 and not (workers == 0 and health == 503):
                return False
            return self.live_workers() >= workers

        try:
            wait_for(ready, timeout, f"treadle up with {workers} workers", every=0.3)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log()}") from None

    def log(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-6000:]}"
            for p in sorted(self.data_dir.rglob("*.log"))
            if "postgres" not in p.parts
        )

    def stop(self) -> None:
        if self._db is not None:
            self._db.dispose()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def start_up(
    data_dir: Path | None = None,
    *,
    workers: int = 2,
    env: dict[str, str] | None = None,
    devices: int = 1,
) -> Iterator[Up]:
    """Run `treadle up` on embedded servers for the block (each worker a group of `devices`
    ranks); its data dir is removed after."""
    # Under /tmp: unix socket paths must stay below 108 bytes.
    own_dir = data_dir is None
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="treadle-fault-"))
    admin_key = "tml-fault-" + secrets.token_hex(8)
    port = free_port()
    full_env = {**os.environ, **FAULT_ENV, **(env or {}), "TREADLE_ADMIN_KEY": admin_key}
    full_env.pop("DATABASE_URL", None)
    full_env.pop("REDIS_URL", None)
    log = (data_dir / "up.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "treadle.cli", "up", "--port", str(port),
         "--data-dir", str(data_dir), "--workers", str(workers), "--devices", str(devices)],
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    up = Up(data_dir, admin_key, f"http://127.0.0.1:{port}", proc)
    try:
        up.wait_ready(workers)
        yield up
    finally:
        up.stop()
        log.close()
        if own_dir:
            shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    """One `treadle up` (2 workers) shared by a module's tests; each test makes its own session."""
    with start_up() as platform:
        yield platform
