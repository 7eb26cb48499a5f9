"""The API's Prometheus metrics: every request counted by route template, method and status, and
timed; the process's resident memory; and the exposition `GET /metrics` serves.

The route label is the Flask URL rule ("/api/v1/retrieve_future"), never the raw path (ids in
paths would make a series per session), and "unmatched" when no rule matched (a 404). The count
is taken in `after_request`, which Flask also runs for the answers of the error handlers, so a
refused request is counted with its real 4xx/5xx status. An answer that took longer than any
long-poll should (`slow_after`) is also logged, with its route, status and time. Under gunicorn (PROMETHEUS_MULTIPROC_DIR
set) every process writes its own files and /metrics sums them all (`MultiProcessCollector`;
`gunicorn_conf` empties the folder at start and drops a dead process's gauges).
Imports platform only; never torch, engine or worker.
"""

from __future__ import annotations

import logging
import time

from flask import Flask, Response, g, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)

from treadle.platform import metrics
from treadle.platform.config import PlatformConfig

REQUESTS = Counter(
    "treadle_http_requests",
    "HTTP requests answered, by route template, method and status",
    ["route", "method", "status"],
)
# Up to the long poll (20 s by default) and a little beyond: retrieve_future waits that long.
DURATION = Histogram(
    "treadle_http_request_duration_seconds",
    "Time from a request's arrival to its answer, by route template and method",
    ["route", "method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60),
)
UNMATCHED = "unmatched"
# A method outside these is labelled "other": a client choosing the label's values could grow
# the series without bound.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# The resident memory gauge is refreshed at most this often per process (and at every scrape).
MEMORY_REFRESH_SECONDS = 5.0

_memory_read_at = 0.0

log = logging.getLogger(__name__)


def install(app: Flask, slow_after: float) -> None:
    """Count and time every request `app` answers, and log a warning for an answer that took
    more than `slow_after` seconds. Call before any other before_request hook is registered, so
    the time includes them (authentication, for one)."""

    @app.before_request
    def start_clock() -> None:
        g.metrics_started = time.perf_counter()

    @app.after_request
    def count(response: Response) -> Response:
        rule = request.url_rule
        route = rule.rule if rule is not None else UNMATCHED
        method = request.method if request.method in METHODS else "other"
        REQUESTS.labels(route, method, str(response.status_code)).inc()
        started = g.get("metrics_started")
        if started is not None:
            seconds = time.perf_counter() - started
            DURATION.labels(route, method).observe(seconds)
            if seconds > slow_after:
                log.warning("slow answer: %s %s %d after %.1f s", method, request.path,
                            response.status_code, seconds)  # fmt: skip
        if time.monotonic() - _memory_read_at >= MEMORY_REFRESH_SECONDS:
            _refresh_memory()
        return response


def exposition(config: PlatformConfig) -> tuple[bytes, str]:
    """The metrics text (Prometheus' format) and its content type: this process's metrics, or
    under gunicorn every process's, summed."""
    _refresh_memory()
    if config.prometheus_multiproc_dir:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=config.prometheus_multiproc_dir)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def _refresh_memory() -> None:
    global _memory_read_at
    _memory_read_at = time.monotonic()
    metrics.PROCESS_MEMORY.labels("api").set(metrics.resident_memory_bytes())
