"""The operation a worker is running: its interrupt, and how its failure is reported.

Every operation runs under a `Running`'s `check`, which the engine calls at each step boundary:
it raises `WorkerClosing` once the worker shuts down (the operation stays pending for the
session's next holder), `OperationCancelledError` once the session was stopped, and
`TimeLimitExceededError` past the execution time limit. `error_of` turns what an operation
raised into the error its settlement records. Imports platform only; never api or the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from treadle.platform.errors import (
    OperationCancelledError,
    TimeLimitExceededError,
    TreadleError,
)
from treadle.platform.operations import operations

__all__ = ["Running", "WorkerClosing", "error_of"]

log = logging.getLogger(__name__)


class WorkerClosing(Exception):
    """The worker is shutting down: the operation stays pending for the session's next holder."""


class Running:
    """The operation now executing: its interrupt raises once it must stop."""

    def __init__(self, closing: threading.Event, op: operations.OperationRow, limit: float) -> None:
        self.closing, self.op, self.limit = closing, op, limit
        self.deadline = time.monotonic() + limit
        self.cancelled: str | None = None

    def check_stop(self) -> None:
        """Raise if the worker is closing or the operation was cancelled (stopped)."""
        if self.closing.is_set():
            raise WorkerClosing
        if self.cancelled is not None:
            raise OperationCancelledError(self.cancelled)

    def check(self) -> None:
        self.check_stop()
        if time.monotonic() > self.deadline:
            raise TimeLimitExceededError(
                f"{self.op.type} ran longer than the execution time limit of {self.limit:g} s "
                "and was stopped; send less work per call (fewer datums, samples or tokens), or "
                "ask the operator to raise TREADLE_OP_TIME_LIMIT_SECONDS"
            )


def error_of(exc: Exception, failed: str) -> dict[str, Any]:
    """The error an operation settles with: a TreadleError as it says; anything else logged
    (with `failed` and its traceback) and reported as an internal error."""
    if isinstance(exc, TreadleError):
        return {"category": exc.category, "code": exc.code, "message": exc.message}
    log.error("%s", failed, exc_info=exc)
    return {"category": "server", "code": "internal", "message": f"{type(exc).__name__}: {exc}"}
