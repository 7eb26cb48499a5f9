"""Admission at the edge: append an operation in one transaction, then wake its worker.

Shared by the training and sampling routes. Imports platform only; never torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa

from treadle.api.app import principal, services
from treadle.platform import operations, routing
from treadle.platform import sessions as sessions_core


def submit(
    session_id: str,
    seq_id: int,
    op_type: str,
    payload: Mapping[str, Any],
    *,
    sampler_id: str | None = None,
    with_request: Callable[[sa.Connection], None] | None = None,
) -> operations.Admission:
    """Append the request (after `with_request`, in the same transaction), then wake its worker."""
    svc = services()
    with svc.db.begin() as conn:
        admission = operations.admit(
            conn, principal(), session_id, seq_id, op_type, payload, sampler_id=sampler_id
        )
        if admission.is_new and with_request is not None:
            with_request(conn)
    if admission.is_new:
        routing.wake(svc.celery, session_id, admission.request_id)
    return admission


def place(session_id: str) -> None:
    """Lease a new session to a live worker and have it consume the session's queue."""
    svc = services()
    with svc.db.begin() as conn:
        worker_id = sessions_core.place_session(conn, session_id, svc.config.lease_ttl_seconds)
    if worker_id is not None:
        routing.start_consuming(svc.celery, worker_id, session_id)
