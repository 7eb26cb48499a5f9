"""The worker's per-operation metrics and log line (treadle/worker/telemetry.py): an
operation's queue wait runs from its admission to the start of its execution."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY

from treadle.platform.eventlog.optypes import OpStatus, OpType
from treadle.platform.operations.operations import OperationRow
from treadle.worker import telemetry


def operation(requested_at: datetime) -> OperationRow:
    return OperationRow(
        request_id="req-telemetry",
        tenant_id="acme",
        session_id="sess-0123456789abcdef:train:0",
        sampler_id=None,
        seq_id=3,
        type=OpType.OPTIM_STEP,
        status=OpStatus.COMPLETED,
        request_position=7,
        result=None,
        error=None,
        requested_at=requested_at,
    )


def histogram_sum(name: str, op_type: str) -> float:
    return REGISTRY.get_sample_value(f"{name}_sum", {"type": op_type}) or 0.0


def test_queue_wait_ends_where_execution_starts_not_after_the_settlement(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Admitted 30 s ago, started 0.25 s after that, ran 2 s: the 27.75 s since then (the
    # settlement, here standing for any time after the run) are not queue wait.
    requested_at = datetime.now(UTC) - timedelta(seconds=30)
    op = operation(requested_at)
    waits = histogram_sum("treadle_operation_queue_wait_seconds", op.type)
    runs = histogram_sum("treadle_operation_execution_seconds", op.type)

    with caplog.at_level(logging.INFO, logger="treadle.operations"):
        telemetry.settled("w0", op, None, 2.0, started_at=requested_at.timestamp() + 0.25)

    assert histogram_sum("treadle_operation_queue_wait_seconds", op.type) - waits == (
        pytest.approx(0.25, abs=1e-6)
    )
    assert histogram_sum("treadle_operation_execution_seconds", op.type) - runs == 2.0
    (line,) = [r for r in caplog.records if r.name == "treadle.operations"]
    assert line.queue_wait_seconds == pytest.approx(0.25, abs=1e-3)  # type: ignore[attr-defined]
    assert line.execution_seconds == 2.0  # type: ignore[attr-defined]
    assert line.outcome == "completed"  # type: ignore[attr-defined]


def test_a_start_before_the_admission_by_the_clocks_counts_as_no_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The admission time is the database's clock, the start the worker's: skewed clocks can put
    # the start first.
    requested_at = datetime.now(UTC)
    op = operation(requested_at)
    waits = histogram_sum("treadle_operation_queue_wait_seconds", op.type)

    with caplog.at_level(logging.INFO, logger="treadle.operations"):
        telemetry.settled("w0", op, None, 0.5, started_at=requested_at.timestamp() - 1.0)

    assert histogram_sum("treadle_operation_queue_wait_seconds", op.type) == waits
    (line,) = [r for r in caplog.records if r.name == "treadle.operations"]
    assert line.queue_wait_seconds == 0.0  # type: ignore[attr-defined]
