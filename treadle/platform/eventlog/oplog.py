"""The per-operation log line: one record on the "treadle.operations" logger per operation, at
admission in the API (outcome "admitted", "duplicate" or "refused") and at settlement in the
worker (outcome "completed" or "failed"), with message "operation" and the operation's fields
as the record's extras, so the JSON log format (`treadle.platform.logs`) writes them as keys.
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import logging

log = logging.getLogger("treadle.operations")


def operation(
    *,
    request_id: str | None,
    session_id: str,
    tenant_id: str,
    type: str,
    seq_id: int | None,
    outcome: str,
    queue_wait_seconds: float | None = None,
    execution_seconds: float | None = None,
    worker_id: str | None = None,
    error_code: str | None = None,
) -> None:
    """Log one operation's admission or settlement (None where a field is not known yet)."""
    extra: dict[str, object] = {
        "request_id": request_id,
        "session_id": session_id,
        "tenant_id": tenant_id,
        "type": type,
        "seq_id": seq_id,
        "queue_wait_seconds": _rounded(queue_wait_seconds),
        "execution_seconds": _rounded(execution_seconds),
        "outcome": outcome,
    }
    if worker_id is not None:
        extra["worker_id"] = worker_id
    if error_code is not None:
        extra["error_code"] = error_code
    log.info("operation", extra=extra)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)
