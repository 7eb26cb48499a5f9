"""The API as compose.yaml runs it: a real gunicorn with two processes, the settings and hooks of
treadle/api/gunicorn_conf.py, the entry treadle/api/wsgi.py, and prometheus_client's
multiprocess mode, against this run's PostgreSQL and Redis."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from treadle.platform.embedded import free_port

pytestmark = pytest.mark.integration

OPERATOR_KEY = "tml-gunicorn-" + secrets.token_hex(8)


@dataclass
class Served:
    base_url: str
    metrics_dir: Path
    healthz_answers: int  # /healthz requests answered while waiting for the start


@pytest.fixture(scope="module")
def gunicorn(services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("gunicorn")
    metrics_dir = root / "metrics"
    metrics_dir.mkdir()
    # Left by an "earlier run": summed into this run's counters unless the master removes it.
    (metrics_dir / "counter_1.db").write_bytes(b"not a metrics file")
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": services.database_url,
        "REDIS_URL": services.redis_url,
        "TREADLE_ADMIN_KEY": OPERATOR_KEY,
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
    }
    argv = [
        sys.executable, "-m", "gunicorn", "-c", "python:treadle.api.gunicorn_conf",
        "-w", "2", "--threads", "4", "-b", f"127.0.0.1:{port}", "treadle.api.wsgi:app",
    ]  # fmt: skip
    log = (root / "gunicorn.log").open("wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    answers = 0
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (root / "gunicorn.log").read_text()
            assert time.monotonic() < deadline, (root / "gunicorn.log").read_text()
            try:
                httpx.get(f"{base_url}/healthz", timeout=5)
                answers += 1
                break
            except httpx.TransportError:
                time.sleep(0.3)
        yield Served(base_url, metrics_dir, answers)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_serves_the_api_and_seeds_the_operator_key(gunicorn: Served) -> None:
    health = httpx.get(f"{gunicorn.base_url}/healthz", timeout=10).json()
    assert health["database"]["ok"] and health["redis"]["ok"]
    listed = httpx.get(
        f"{gunicorn.base_url}/api/v1/treadle/tenants",
        headers={"X-API-Key": OPERATOR_KEY},
        timeout=10,
    )
    assert listed.status_code == 200, listed.text
    refused = httpx.get(
        f"{gunicorn.base_url}/api/v1/treadle/tenants",
        headers={"X-API-Key": "tml-not-a-key-" + secrets.token_hex(4)},
        timeout=10,
    )
    assert refused.status_code == 401


def test_metrics_sum_every_process_and_start_from_an_empty_folder(gunicorn: Served) -> None:
    assert not (gunicorn.metrics_dir / "counter_1.db").exists()
    route = "/api/v1/openapi.json"
    sent = 0
    with httpx.Client(timeout=10) as client:  # new connections spread over both processes
        while len(_processes_that_counted(gunicorn.metrics_dir, route)) < 2 and sent < 400:
            for _ in range(10):
                client.get(f"{gunicorn.base_url}{route}", headers={"Connection": "close"})
            sent += 10
    assert len(_processes_that_counted(gunicorn.metrics_dir, route)) == 2, sent
    text = httpx.get(f"{gunicorn.base_url}/metrics", timeout=10).text
    counted = [
        float(value)
        for value in re.findall(
            r'^treadle_http_requests_total\{[^}]*route="/api/v1/openapi.json"[^}]*\} (\S+)$',
            text,
            flags=re.MULTILINE,
        )
    ]
    assert sum(counted) == sent


def _processes_that_counted(metrics_dir: Path, route: str) -> set[str]:
    """The pids whose counter file holds a sample of `route` (each process writes its own file,
    with the samples' names and labels as text)."""
    return {
        p.stem.rsplit("_", 1)[1]
        for p in metrics_dir.glob("counter_*.db")
        if route.encode() in p.read_bytes()
    }
