"""Run `treadle up` as a child process for a recipe: start, wait until it serves, stop cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx


class LocalPlatform:
    """`with LocalPlatform(data_dir) as p:` runs the embedded platform for the block's duration."""

    def __init__(
        self, data_dir: Path, port: int, admin_key: str, *, embedded: bool = True, workers: int = 1
    ) -> None:
        self.data_dir = data_dir
        self.workers = workers
        self.port = port
        self.admin_key = admin_key
        self.base_url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, "TREADLE_ADMIN_KEY": admin_key}
        if embedded:  # the demo runs on the embedded default, whatever the shell has set
            self.env.pop("DATABASE_URL", None)
            self.env.pop("REDIS_URL", None)
        self.proc: subprocess.Popen[bytes] | None = None
        self._sigterm: Any = None

    def __enter__(self) -> LocalPlatform:
        # A run ended by SIGTERM (`timeout`, a job scheduler) would die without leaving this
        # block, and the platform (PostgreSQL, Redis, the API, the workers) would outlive it,
        # holding its port and data dir. As SystemExit the block is left and the platform stops.
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.data_dir / "up.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treadle.cli", "up", "--port", str(self.port),
             "--data-dir", str(self.data_dir), "--workers", str(self.workers)],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            self._wait_ready(timeout=300)
        except BaseException:  # a platform that never served is stopped too
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        headers = {"X-API-Key": self.admin_key}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"treadle up exited; see {self.data_dir / 'up.log'}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200:
                    httpx.get(f"{self.base_url}/api/v1/treadle/base_models", headers=headers)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the platform did not start in {timeout:.0f} s")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
