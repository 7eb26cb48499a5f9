"""Error translation at the edge: every error becomes JSON `{"error": {code, message}}` with its
status. A dependency that cannot be reached (PostgreSQL, Redis, the Celery broker) is a 503 with
Retry-After, never a 500, so clients back off; anything else unexpected stays a 500. A training
request refused with a 4xx has its seq_id remembered, so the session's next operation does not
wait for it. Imports platform only; never torch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kombu.exceptions
import redis
import sqlalchemy as sa
from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from treadle.api.context import RETRY_AFTER_SECONDS, Services
from treadle.platform import metrics
from treadle.platform.errors import LimitError, TreadleError, UnavailableError
from treadle.platform.operations import operations
from treadle.platform.sessions import routing

log = logging.getLogger(__name__)

# tinker's future polling (tinker/lib/api_future_impl.py, `_rest_status_error_to_transport_error`)
# retries any 5xx of retrieve_future at once, ignoring Retry-After: such an answer is held until
# Retry-After seconds (at most one long-poll) after the request came, so a poller backs off.
HELD_PATHS = ("/api/v1/retrieve_future",)


def register(app: Flask, svc: Services) -> None:
    """Install the error handlers on `app`."""

    @app.errorhandler(TreadleError)
    def treadle_error(exc: TreadleError) -> Any:
        if isinstance(exc, UnavailableError):
            return unavailable(exc, svc.config.long_poll_seconds)
        remember_refusal(svc, exc.status)
        if isinstance(exc, LimitError):
            return refused_by_quota(exc)
        return jsonify(error={"code": exc.code, "message": exc.message}), exc.status

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        message = exc.description or exc.name
        if exc.code == 404:
            message = f"no route {request.method} {request.path}; see docs/api.md for the routes"
        elif exc.code == 413:
            message = (
                "the request body is larger than this server's limit of "
                f"{svc.config.max_body_bytes} bytes (TREADLE_MAX_BODY_BYTES); send smaller "
                "requests: split a forward_backward batch into chunks of at most "
                f"{svc.config.fwdbwd_chunk_bytes} bytes (the tinker SDK does, as "
                "POST /api/v1/client/config tells it)"
            )
        return jsonify(
            error={"code": exc.name.lower().replace(" ", "_"), "message": message}
        ), exc.code

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Any:
        down = dependency_failure(exc)
        if down is not None:
            log.warning("%s %s: %s (%s)", request.method, request.path, down.message, exc)
            return unavailable(down, svc.config.long_poll_seconds)
        log.exception("unhandled error on %s %s", request.method, request.path)
        return jsonify(error={"code": "internal", "message": "internal server error"}), 500


def dependency_failure(exc: BaseException) -> UnavailableError | None:
    """The UnavailableError that `exc` stands for when it (or an exception it was raised from)
    says PostgreSQL, Redis or the Celery broker cannot be reached; None for anything else."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        what = _unreachable(seen)
        if what is not None:
            return UnavailableError(
                f"{what}; retry in {RETRY_AFTER_SECONDS} s", retry_after=RETRY_AFTER_SECONDS
            )
        seen = seen.__cause__
    return None


def _unreachable(exc: BaseException) -> str | None:
    if isinstance(exc, sa.exc.TimeoutError):
        return "PostgreSQL has no free connection (the API's connection pool is exhausted)"
    if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError) or (
        isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated
    ):
        return "PostgreSQL is unreachable"
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return "Redis is unreachable"
    if isinstance(exc, kombu.exceptions.OperationalError):
        return "the Celery broker (Redis) is unreachable"
    return None


def unavailable(exc: UnavailableError, long_poll_seconds: float) -> Response:
    """The 503 answer: the usual error body plus Retry-After. A poller that ignores Retry-After
    (HELD_PATHS) gets it only `retry_after` seconds (at most one long-poll) after it asked."""
    if request.path in HELD_PATHS:
        hold = min(float(exc.retry_after), long_poll_seconds)
        started = g.get("started", time.monotonic())
        time.sleep(max(0.0, started + hold - time.monotonic()))
    response = jsonify(error={"code": exc.code, "message": exc.message})
    response.status_code = exc.status
    response.headers["Retry-After"] = str(exc.retry_after)
    return response


def refused_by_quota(exc: LimitError) -> Response:
    """A 402/413/429 whose error names the limit, its value, the current use and when it
    resets; a 429 also says when to retry (Retry-After), which the SDK honours."""
    metrics.count_rejection(str(exc.details["limit"]))
    response = jsonify(error={"code": exc.code, "message": exc.message, **exc.details})
    response.status_code = exc.status
    if exc.retry_after is not None:
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def remember_refusal(svc: Services, status: int) -> None:
    """A training request refused at admission (a 4xx the SDK does not retry): record its seq_id
    so the session's next operation does not wait for it, and wake the session's worker."""
    seq = g.pop("training_seq", None)
    if seq is None or "principal" not in g or not 400 <= status < 500 or status in (408, 429):
        return
    model_id, seq_id = seq
    try:
        with svc.db.begin() as conn:
            recorded = operations.record_refusal(conn, g.principal, model_id, seq_id)
        if recorded:
            routing.wake(svc.celery, model_id, None)
    except Exception as exc:  # the worker still skips it after the gap timeout
        log.warning("could not record the refusal of %s seq %d: %s", model_id, seq_id, exc)
