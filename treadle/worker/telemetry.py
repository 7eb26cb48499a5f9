"""The worker's Prometheus counters and histograms, and its per-operation log line.

`settled` counts a newly settled operation (by type and outcome), observes its queue wait
(admission to execution start) and execution time, and writes its "treadle.operations" line.
The gauges and the metrics server are `gauges`'. Recoveries and replayed operations are counted in
`recovery`. No session, request or key ids in labels. Imports platform only; never api.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram

from treadle.platform.eventlog import oplog
from treadle.platform.operations import operations

OPERATIONS = Counter(
    "treadle_operations",
    "Operations settled by this worker, by type and outcome (completed or failed)",
    ["type", "outcome"],
)
# From milliseconds (a sample joining a running batch) to minutes (a long forward_backward, or
# an operation queued behind one).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
QUEUE_WAIT = Histogram(
    "treadle_operation_queue_wait_seconds",
    "Time from an operation's admission to the start of its execution on the worker",
    ["type"],
    buckets=_BUCKETS,
)
EXECUTION = Histogram(
    "treadle_operation_execution_seconds",
    "Time an operation ran on the engine (a sample: from joining its batch to finishing)",
    ["type"],
    buckets=_BUCKETS,
)
RECOVERIES = Counter(
    "treadle_recoveries",
    "Sessions rebuilt from their log by a new holder: recovered, diverged (a replayed step did "
    "not reproduce its recorded state) or failed (something the replay needs is gone)",
    ["outcome"],
)
REPLAYED = Counter(
    "treadle_replayed_operations",
    "Operations replayed while recovering sessions, by type",
    ["type"],
)


def settled(
    worker_id: str,
    op: operations.OperationRow,
    error: dict[str, Any] | None,
    seconds: float,
    started_at: float,
) -> None:
    """Count an operation this worker has just settled (only a new settlement: a retried one
    was counted the first time) and log it. `seconds`: its execution time; `started_at`: when
    its execution began (`time.time()`), so its queue wait leaves out the settlement."""
    outcome = "completed" if error is None else "failed"
    OPERATIONS.labels(op.type, outcome).inc()
    EXECUTION.labels(op.type).observe(seconds)
    wait = None
    if op.requested_at is not None:
        # The admission time is the database's clock, so a clock skew between the two hosts
        # could make it negative.
        wait = max(0.0, started_at - op.requested_at.timestamp())
        QUEUE_WAIT.labels(op.type).observe(wait)
    oplog.operation(
        request_id=op.request_id,
        session_id=op.session_id,
        tenant_id=op.tenant_id,
        type=op.type,
        seq_id=op.seq_id,
        outcome=outcome,
        queue_wait_seconds=wait,
        execution_seconds=seconds,
        worker_id=worker_id,
        error_code=None if error is None else str(error.get("code")),
    )
