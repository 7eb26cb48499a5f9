"""An operation's interrupt: the execution time limit, a stop, and the worker shutting down."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from treadle.platform.errors import OperationCancelledError, TimeLimitExceededError
from treadle.worker.running import Running, WorkerClosing


def _running(limit: float) -> tuple[Running, threading.Event]:
    closing = threading.Event()
    op = SimpleNamespace(type="sample", request_id="req-1")
    return Running(closing, op, limit), closing  # type: ignore[arg-type]


def test_an_operation_within_its_time_limit_goes_on() -> None:
    run, _ = _running(60)
    run.check()


def test_an_operation_past_its_time_limit_fails_saying_how_to_fix_it() -> None:
    run, _ = _running(0)
    with pytest.raises(TimeLimitExceededError, match="TREADLE_OP_TIME_LIMIT_SECONDS"):
        run.check()


def test_a_cancelled_operation_stops() -> None:
    run, _ = _running(60)
    run.cancelled = "model m was stopped"
    with pytest.raises(OperationCancelledError, match="stopped"):
        run.check()


def test_a_closing_worker_stops_its_operation_before_anything_else() -> None:
    run, closing = _running(0)
    closing.set()
    with pytest.raises(WorkerClosing):
        run.check()
