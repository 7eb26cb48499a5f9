"""Shared fixtures: real services (the machine's PostgreSQL/Redis when DATABASE_URL/REDIS_URL
are set, embedded ones otherwise), a fresh database per test run, and a running platform
(`treadle up` as a subprocess: API, a Celery worker process, PostgreSQL, Redis)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import sqlalchemy as sa

# Before any test module imports mlflow: otherwise it stops `sqlalchemy.engine` propagating, and
# the tests that read SQL statements from the log capture (tests/security) see none.
os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
# Every worker the tests start (several platforms of two workers at once on CI's 24 GiB) keeps
# 512 MiB of freed heap for its next passes, not the default 4 GiB each (engine/memory/heap.py).
os.environ.setdefault("TREADLE_WORKER_FREE_HEAP", str(512 * 2**20))

from tests.databases import private_database
from tests.mlflow_server import mlflow_server
from tests.secure_app import SecureApp, running_secure_app
from treadle.client.admin import AdminClient
from treadle.platform import db
from treadle.platform.child_process import ending_with_parent
from treadle.platform.embedded import PORT_RANGE_ENV, EmbeddedServices, free_port, port_range

ADMIN_KEY = "tml-test-admin-" + secrets.token_hex(8)


@dataclass(frozen=True)
class Services:
    database_url: str
    redis_url: str


def xdist_index() -> int | None:
    """This test process's index under pytest-xdist (PYTEST_XDIST_WORKER "gw<i>"), else None."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") else None


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each test process picks its servers' ports (`free_port`, here and in
    the platforms it starts, which inherit the environment) from a block of its own, so two
    processes never pick the same port in the moment between the pick and the listen. The
    tinker SDK's telemetry is off."""
    # The tinker SDK sends no telemetry here (the platforms started inherit this too), except in
    # the test about it: Treadle drops it, and with tinker 0.38 on Python 3.11 its flush task can
    # swallow the cancellation ServiceClient.close() waits for, which then never returns (a
    # suite once hung on it; docs/tinker-compatibility.md, "Known SDK faults").
    os.environ["TINKER_TELEMETRY"] = "0"
    index = xdist_index()
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if index is not None and (block := port_block(port_range(), index, count)):
        os.environ[PORT_RANGE_ENV] = block


def port_block(ports: tuple[int, int], index: int, count: int) -> str:
    """Block `index` of `count` equal, disjoint slices of `ports` (low, high), as
    TREADLE_PORT_RANGE; "" for a single process or a range too small to slice. pytest-xdist
    numbers the process that replaces a crashed one past the count (gw2 of 2): it takes the
    block of the slot it fills (the crashed process's servers may still hold some of its ports;
    `free_port` passes over those), never one beyond the range."""
    low, high = ports
    size = (high - low + 1) // count
    if count < 2 or size < 1000:
        return ""
    slot = index % count
    return f"{low + slot * size}-{low + (slot + 1) * size - 1}"


def worker_redis_url(redis_url: str) -> str:
    """The machine's Redis for this test process: under pytest-xdist, worker N uses database
    base + N, so two workers' Celery queues and control messages never meet (each worker's
    PostgreSQL database is its own already; embedded servers are per process)."""
    index = xdist_index()
    if not redis_url or index is None:
        return redis_url
    parts = urlsplit(redis_url)
    base = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{base + index}"))


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    # Outside pytest's basetemp: another pytest run rotating its numbered dirs must not delete a
    # live server's data.
    root = Path(tempfile.mkdtemp(prefix="treadle-test-"))
    embedded = EmbeddedServices(root)
    server_url, redis_url = embedded.start(
        os.environ.get("DATABASE_URL", ""), worker_redis_url(os.environ.get("REDIS_URL", ""))
    )
    name = f"treadle_test_{os.getpid()}_{secrets.token_hex(3)}"
    admin = sa.create_engine(db.sqlalchemy_url(server_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(db.sqlalchemy_url(server_url)).set(database=name)
    database_url = url.render_as_string(hide_password=False).replace("+psycopg", "")
    db.migrate(database_url)
    try:
        yield Services(database_url, redis_url)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
        embedded.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def engine(services: Services) -> Iterator[sa.Engine]:
    eng = db.connect(services.database_url, pool_size=5)
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def secure(services: Services) -> Iterator[SecureApp]:
    """The API in process on a database of its own (see tests/secure_app.py)."""
    with running_secure_app(services) as app:
        yield app


@pytest.fixture(scope="session")
def quiet_engine(services: Services) -> Iterator[sa.Engine]:
    """A migrated database of its own, on the same server, that no worker watches: a session
    created there directly stays exactly as the test left it (the served platform's workers
    claim any unleased session of the run's main database)."""
    with private_database(services.database_url, "treadle_quiet") as url:
        eng = db.connect(url, pool_size=2)
        yield eng
        eng.dispose()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server (tests/mlflow_server.py) for this test run."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@dataclass(frozen=True)
class Platform:
    base_url: str
    admin_key: str
    database_url: str
    redis_url: str
    data_dir: Path


@pytest.fixture(scope="session")
def platform(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """`treadle up` on a free port against this run's database and Redis."""
    with served_platform(
        services.database_url, services.redis_url, tmp_path_factory.mktemp("platform")
    ) as served:
        yield served


@contextlib.contextmanager
def served_platform(
    database_url: str,
    redis_url: str,
    data_dir: Path,
    *,
    workers: int = 2,
    devices: int = 1,
    env: dict[str, str] | None = None,
) -> Iterator[Platform]:
    """`treadle up` with `workers` workers (each a group of `devices` ranks) on a free port
    against `database_url` and `redis_url`, with `env` added to its environment."""
    port = free_port()
    full_env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "TREADLE_ADMIN_KEY": ADMIN_KEY,
        "TREADLE_LONG_POLL_SECONDS": "5",
        # Recovery points every few steps, so forks start from one (tests/integration/test_lineage)
        "TREADLE_AUTO_CHECKPOINT_STEPS": "3",
        # SigV4 scopes it accepts: a request signed for another region is refused
        # (tests/compat/test_sagemaker_routes.py)
        "TREADLE_AWS_REGIONS": "us-west-2,us-east-1",
        **(env or {}),
    }
    log = open(data_dir / "up.log", "wb")  # noqa: SIM115
    # ends with this test process however it ends (a test over its time limit ends it at once)
    proc = subprocess.Popen(
        ending_with_parent(
            [
                sys.executable,
                "-m",
                "treadle.cli",
                "up",
                "--port",
                str(port),
                "--data-dir",
                str(data_dir),
                "--workers",
                str(workers),
                "--devices",
                str(devices),
            ]
        ),
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_ready(proc, base_url, database_url, data_dir, workers)
        yield Platform(base_url, ADMIN_KEY, database_url, redis_url, data_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def new_tenant_key(platform: Platform, name: str) -> str:
    """The API key of a new tenant `<name>-<random>` on `platform`, made with its operator key."""
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        return str(admin.create_tenant(f"{name}-{secrets.token_hex(3)}")["api_key"])
    finally:
        admin.close()


def _wait_until_ready(
    proc: subprocess.Popen[bytes], base_url: str, database_url: str, data_dir: Path, workers: int
) -> None:
    eng = db.connect(database_url, pool_size=1)
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("treadle up exited:\n" + (data_dir / "up.log").read_text())
            try:
                healthy = httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy:
                with eng.connect() as conn:
                    count = conn.execute(sa.text("SELECT count(*) FROM workers")).scalar_one()
                    if count >= workers:
                        return
            time.sleep(0.5)
        logs = "\n".join(p.read_text() for p in sorted(data_dir.rglob("*.log")))
        raise RuntimeError("the platform did not become ready in 180 s:\n" + logs)
    finally:
        eng.dispose()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run where CUDA is present and are deselected (not skipped) elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
