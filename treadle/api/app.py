"""Flask app factory: wires the platform's services, authentication and error translation.

Views live in the `routes_*` blueprints; they parse, call the platform core and serialise.
A dependency that cannot be reached (PostgreSQL, Redis, the Celery broker) is a 503 with
Retry-After, never a 500, so clients back off; anything else unexpected stays a 500.
Imports platform only; never torch or gpu_worker.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import kombu.exceptions
import redis
import sqlalchemy as sa
from celery import Celery
from flask import Flask, Response, current_app, g, jsonify, request
from redis import Redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry
from werkzeug.exceptions import HTTPException

from treadle.platform import db, notify, operations, routing, storage, tenants
from treadle.platform.config import PlatformConfig
from treadle.platform.errors import TreadleError, UnavailableError, ValidationError
from treadle.platform.routing import make_celery

log = logging.getLogger(__name__)

PUBLIC_PATHS = ("/healthz", "/api/v1/healthz")

# How long a client should wait after a dependency failed (the Retry-After header). The tinker
# SDK's ordinary requests honour it (up to 60 s; tinker/_base_client.py _calculate_retry_timeout).
RETRY_AFTER_SECONDS = 5
CONNECT_TIMEOUT_SECONDS = 3
# tinker's future polling (tinker/lib/api_future_impl.py, `_rest_status_error_to_transport_error`)
# retries any 5xx of retrieve_future at once, ignoring Retry-After: such an answer is held until
# Retry-After seconds (at most one long-poll) after the request came, so a poller backs off.
HELD_PATHS = ("/api/v1/retrieve_future",)


@dataclass
class Services:
    """The API process's connections, built once in `create_app`; `close()` releases them.

    `probe_db` and `probe_redis` serve /healthz only: small, with short timeouts, so a health
    check answers within seconds even when the main pool is busy or a dependency hangs.
    """

    config: PlatformConfig
    db: sa.Engine
    celery: Celery
    redis: Redis
    store: storage.ObjectStore
    notices: notify.NoticeHub
    probe_db: sa.Engine
    probe_redis: Redis

    def close(self) -> None:
        self.notices.close()
        self.db.dispose()
        self.probe_db.dispose()
        self.redis.close()
        self.probe_redis.close()


def services() -> Services:
    return current_app.extensions["treadle"]  # type: ignore[no-any-return]


def principal() -> tenants.Principal:
    return g.principal  # type: ignore[no-any-return]


def create_app(config: PlatformConfig) -> Flask:
    from treadle.api import (
        routes_checkpoints,
        routes_futures,
        routes_sampling,
        routes_sessions,
        routes_training,
        routes_treadle,
    )

    app = Flask("treadle")
    app.json.sort_keys = False  # type: ignore[attr-defined]
    client = redis.Redis.from_url(
        config.redis_url,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        socket_timeout=10,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 2),
    )
    svc = Services(
        config=config,
        db=db.connect(_fail_fast(config.database_url), pool_size=20),
        celery=make_celery(config.redis_url),
        redis=client,
        store=storage.store_from_config(config),
        notices=notify.NoticeHub(client).start(),
        probe_db=db.connect(_fail_fast(config.database_url), pool_size=1),
        probe_redis=redis.Redis.from_url(
            config.redis_url,
            socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
            socket_timeout=CONNECT_TIMEOUT_SECONDS,
            retry=Retry(NoBackoff(), 0),
        ),
    )
    app.extensions["treadle"] = svc
    if config.admin_key:
        with svc.db.begin() as conn:
            tenants.seed_key(conn, tenants.DEFAULT_TENANT, config.admin_key, "admin")

    for module in (
        routes_sessions,
        routes_training,
        routes_checkpoints,
        routes_sampling,
        routes_futures,
        routes_treadle,
    ):
        app.register_blueprint(module.bp)

    @app.before_request
    def authenticate() -> None:
        g.started = time.monotonic()
        if "\x00" in request.path or "\x00" in request.query_string.decode("latin-1"):
            raise ValidationError("the URL contains a NUL character; remove it")
        if request.path in PUBLIC_PATHS:
            return
        with svc.db.connect() as conn:
            g.principal = tenants.authenticate(conn, request.headers.get("X-API-Key"))

    @app.errorhandler(TreadleError)
    def treadle_error(exc: TreadleError) -> Any:
        if isinstance(exc, UnavailableError):
            return unavailable(exc, svc.config.long_poll_seconds)
        _remember_refusal(svc, exc.status)
        return jsonify(error={"code": exc.code, "message": exc.message}), exc.status

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        message = exc.description or exc.name
        if exc.code == 404:
            message = f"no route {request.method} {request.path}; see docs/api.md for the routes"
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

    return app


def _fail_fast(database_url: str) -> str:
    """The database URL with a short connect timeout (unless it names one), so a request fails
    within seconds, not minutes, when PostgreSQL's host cannot be reached."""
    url = sa.make_url(db.sqlalchemy_url(database_url))
    if "connect_timeout" not in url.query:
        url = url.update_query_dict({"connect_timeout": str(CONNECT_TIMEOUT_SECONDS)})
    return url.render_as_string(hide_password=False)


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


def _remember_refusal(svc: Services, status: int) -> None:
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


def json_body() -> Any:
    return request.get_json(force=True, silent=True)


def int_arg(name: str, default: int, low: int, high: int) -> int:
    """An integer query parameter within [low, high]; a 400 otherwise."""
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError(f"query parameter {name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise ValidationError(f"query parameter {name} must be between {low} and {high}")
    return value
