"""The gunicorn entry (treadle/api/wsgi.py) and its settings and hooks (gunicorn_conf.py);
tests/integration/test_gunicorn.py serves the API through a real gunicorn."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from treadle.api import gunicorn_conf


def test_entry_refuses_to_start_without_the_platforms_servers() -> None:
    """No DATABASE_URL/REDIS_URL: a message naming both, not an embedded server nor a traceback
    from deep inside SQLAlchemy."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    done = subprocess.run(
        [sys.executable, "-c", "import treadle.api.wsgi"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "treadle.api.wsgi needs DATABASE_URL and REDIS_URL" in done.stderr
    assert "treadle migrate" in done.stderr


def test_threaded_workers_so_a_long_poll_does_not_block_a_process() -> None:
    assert gunicorn_conf.worker_class == "gthread"
    assert gunicorn_conf.threads > 1
    # longer than the default long poll (20 s): a waiting retrieve_future is not a stuck worker
    assert gunicorn_conf.timeout > 20


def test_start_empties_the_metrics_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "metrics"
    folder.mkdir()
    (folder / "counter_4242.db").write_bytes(b"stale")
    (folder / "gauge_livesum_4242.db").write_bytes(b"stale")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    gunicorn_conf.on_starting(server=None)
    assert list(folder.iterdir()) == []


def test_start_creates_a_missing_metrics_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "not-yet"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    gunicorn_conf.on_starting(server=None)
    assert folder.is_dir()


def test_dead_worker_loses_its_live_gauges_and_keeps_its_counters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("counter_4242.db", "gauge_livesum_4242.db", "gauge_livesum_4343.db"):
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    gunicorn_conf.child_exit(server=None, worker=SimpleNamespace(pid=4242))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "counter_4242.db",
        "gauge_livesum_4343.db",
    ]
