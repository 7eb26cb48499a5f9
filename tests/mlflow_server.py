"""A real MLflow tracking server for the tests: `mlflow server` with a SQLite backend store and
a local artifact folder (served through it, as a team's server does), on a free port; stopped,
with every process it started, after the block."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from treadle.platform.embedded import free_port

START_TIMEOUT_S = 180


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[str]:
    """Yields the server's tracking URI."""
    port = free_port()
    log = open(root / "mlflow-server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", str(root / "artifacts"),
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        ],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(uri):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "mlflow server did not start:\n" + (root / "mlflow-server.log").read_text()
                )
            time.sleep(0.5)
        yield uri
    finally:
        # uvicorn's worker is a child of its own: stop the whole group the server leads.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _healthy(uri: str) -> bool:
    try:
        return httpx.get(f"{uri}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
