"""Prometheus metrics that both the API and the workers count: tokens and cost by token class,
base model and tenant; quota rejections; operations admitted; event appends and append
conflicts; lease changes; the process's resident memory (what a charge adds to the token and
cost counters is counted by `metering.count_charge`). The catalogue (names, labels, what
each counts) is in docs/operations.md, "Metrics".

What a transaction records is counted once it commits (`after_commit`), so a retried
settlement or a refused request that rolled back is not counted. No session, request or key
ids in labels. The HTTP metrics and /metrics route are the API's (`treadle.api.telemetry`), the
operation metrics the worker's (`treadle.worker.telemetry`, its gauges `gauges`).
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa
from prometheus_client import Counter, Gauge

from treadle.platform.after_commit import after_commit

TOKENS = Counter(
    "treadle_tokens",
    "Tokens processed by completed operations",
    ["token_class", "base_model", "tenant"],
)
COST = Counter(
    "treadle_cost_usd",
    "Cost of completed operations, at the prices in effect when they completed",
    ["token_class", "base_model", "tenant"],
)
REJECTIONS = Counter(
    "treadle_quota_rejections",
    "Requests refused by a quota, by the limit they met",
    ["reason"],
)
ADMITTED = Counter(
    "treadle_operations_admitted",
    "Operations admitted (appended to the log; a resent request is not counted again)",
    ["type"],
)
EVENT_APPENDS = Counter(
    "treadle_event_appends",
    "Events appended to the event store (committed), by event type",
    ["type"],
)
APPEND_CONFLICTS = Counter(
    "treadle_event_append_conflicts",
    "Writes the event store refused: a settlement by a worker whose lease epoch is no longer "
    'current ("stale_lease"), a resent seq_id with another payload ("seq_conflict")',
    ["reason"],
)
LEASE_CHANGES = Counter(
    "treadle_lease_changes",
    'Session leases given or taken: "placed" (a new session, by the API), "claimed" (an '
    'unleased session, by a worker), "orphan" (taken from a dead worker), "released"',
    ["reason"],
)
# Under gunicorn every API process writes its own value; a scrape sums the live ones.
PROCESS_MEMORY = Gauge(
    "treadle_process_resident_memory_bytes",
    "Resident memory of the process (summed over an API's live processes)",
    ["component"],
    multiprocess_mode="livesum",
)

_STATM = Path("/proc/self/statm")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def count_rejection(reason: str) -> None:
    REJECTIONS.labels(reason).inc()


def count_append(conn: sa.Connection, event_type: str) -> None:
    """Count an event appended in `conn`'s transaction, once it commits."""
    after_commit(conn, EVENT_APPENDS.labels(event_type).inc)


def count_lease_change(conn: sa.Connection, reason: str, n: int = 1) -> None:
    """Count `n` lease changes made in `conn`'s transaction, once it commits."""
    if n:
        after_commit(conn, lambda: LEASE_CHANGES.labels(reason).inc(n))


def count_conflict(reason: str) -> None:
    APPEND_CONFLICTS.labels(reason).inc()


def resident_memory_bytes() -> float:
    """This process's resident set size in bytes (0 where /proc is not available)."""
    try:
        return float(int(_STATM.read_text().split()[1]) * _PAGE_BYTES)
    except (OSError, ValueError, IndexError):
        return 0.0
