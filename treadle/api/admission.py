"""Admission at the edge: append an operation in one transaction, then wake its worker.

Shared by the training and sampling routes. A route that reads a training request's model id and
seq_id calls `expect_seq` first: if the request is then refused (a 4xx), the app's error handler
records the refusal so the session's next operation does not wait for that seq_id. A new session
is created only while a worker is alive (`require_live_worker`) and leased at once (`place`).
Imports platform only; never torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import kombu.exceptions
import sqlalchemy as sa
from flask import g

from treadle.api.app import json_body, principal, services
from treadle.api.schemas import B, parse
from treadle.platform import leases, operations, routing
from treadle.platform.errors import UnavailableError
from treadle.platform.optypes import Payload

log = logging.getLogger(__name__)

MAX_SEQ = 2**62
# A worker restarted by `treadle up` heartbeats within seconds.
NO_WORKER_RETRY_SECONDS = 10


def expect_seq(model_id: Any, seq_id: Any) -> None:
    """Note the training seq_id this request carries (if it reads as one)."""
    if (
        isinstance(model_id, str)
        and isinstance(seq_id, int)
        and not isinstance(seq_id, bool)
        and 0 <= seq_id < MAX_SEQ
    ):
        g.training_seq = (model_id, seq_id)


def parse_training(model: type[B]) -> B:
    """Parse a training request's JSON body, noting its seq_id first (even if parsing fails)."""
    raw = json_body()
    if isinstance(raw, dict):
        expect_seq(raw.get("model_id"), raw.get("seq_id"))
    return parse(model, raw)


def submit(
    session_id: str,
    seq_id: int,
    payload: Payload,
    *,
    sampler_id: str | None = None,
    with_request: Callable[[sa.Connection], None] | None = None,
) -> operations.Admission:
    """Append the request (after `with_request`, in the same transaction), then wake its worker.

    The request is in the log once this commits; a wake-up that cannot be sent (the broker is
    down) is only logged: the worker's lease keeper re-wakes operations left pending.
    """
    svc = services()
    with svc.db.begin() as conn:
        admission = operations.admit(
            conn, principal(), session_id, seq_id, payload, sampler_id=sampler_id
        )
        if admission.is_new and with_request is not None:
            with_request(conn)
    g.pop("training_seq", None)  # admitted: not a refusal, whatever happens next
    if admission.is_new:
        try:
            routing.wake(svc.celery, session_id, admission.request_id)
        except Exception as exc:  # the log is the truth; the wake-up is a hint
            log.warning("could not wake %s for %s: %s", session_id, admission.request_id, exc)
    return admission


def require_live_worker(conn: sa.Connection) -> None:
    """Refuse (503) to create a session while no worker is alive to host it; call before the
    session is created, in the same transaction."""
    config = services().config
    if not leases.live_workers(conn, config.lease_ttl_seconds):
        raise UnavailableError(
            f"no worker is alive (none heartbeated in the last {config.lease_ttl_seconds:g} s) "
            "to host a new session; start one (`treadle worker`, or `treadle up`, which restarts "
            f"dead workers) and retry in {NO_WORKER_RETRY_SECONDS} s",
            retry_after=NO_WORKER_RETRY_SECONDS,
        )


def place(session_id: str) -> None:
    """Lease a new session to a live worker and have it consume the session's queue.

    The lease is the truth: a consume request that cannot be sent (the broker is down) is only
    logged, since the holder's lease keeper starts consuming its sessions' queues by itself.
    """
    svc = services()
    with svc.db.begin() as conn:
        worker_id = leases.place_session(conn, session_id, svc.config.lease_ttl_seconds)
    if worker_id is not None:
        try:
            routing.start_consuming(svc.celery, worker_id, session_id)
        except kombu.exceptions.OperationalError as exc:
            log.warning("could not ask %s to consume %s: %s", worker_id, session_id, exc)
