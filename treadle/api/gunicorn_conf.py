"""gunicorn settings and hooks for the API:
`gunicorn -c python:treadle.api.gunicorn_conf -w N -b 0.0.0.0:8080 treadle.api.wsgi:app`.

Threaded workers: a long-polled `retrieve_future` holds its thread for up to the long poll
(TREADLE_LONG_POLL_SECONDS, 20 s), so each process serves `threads` requests at once.
prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR set): the master empties the
folder before it forks (files left by an earlier run would be summed into this one's counters),
and forgets a dead worker's live gauges. Runs in gunicorn's master process, so it imports
nothing of the app (no flask, no database): the app is built in each worker (`wsgi`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from treadle.platform import logs
from treadle.platform.config import PlatformConfig

worker_class = "gthread"
threads = 64  # x 4 processes: the 256 concurrent requests `treadle up`'s waitress serves
# gthread workers heartbeat from their main thread, so a long poll never trips this; a worker
# stuck this long in one request is restarted.
timeout = 120
graceful_timeout = 30  # a stop lets running requests (and long polls) finish first
keepalive = 5
# Heartbeat files on tmpfs: on a container's overlay filesystem an fsync can stall the check.
worker_tmp_dir = "/dev/shm" if Path("/dev/shm").is_dir() else None
# The API's own log lines (platform.logs, JSON by default) carry what an access log would.
accesslog = None
# gunicorn's own lines (booting, a worker's crash) in the app's log format too.
logconfig_dict = logs.gunicorn_logconfig(PlatformConfig.from_env().log_format)


def on_starting(server: Any) -> None:
    """Before the first fork: start the metrics folder empty."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not folder:
        return
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()


def child_exit(server: Any, worker: Any) -> None:
    """A worker process ended: its live gauges stop counting (its counters stay summed)."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid, folder)
