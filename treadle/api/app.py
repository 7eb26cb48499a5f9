"""Flask app factory: wires the platform's services, authentication and error translation.

Views live in the `routes_*` blueprints; they parse, call the platform core and serialise.
Imports platform only; never torch or gpu_worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery
from flask import Flask, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException

from treadle.platform import db, operations, routing, storage, tenants
from treadle.platform.config import PlatformConfig
from treadle.platform.errors import TreadleError, ValidationError
from treadle.platform.routing import make_celery

log = logging.getLogger(__name__)

PUBLIC_PATHS = ("/healthz", "/api/v1/healthz")


@dataclass
class Services:
    """The API process's connections, built once in `create_app`."""

    config: PlatformConfig
    db: sa.Engine
    celery: Celery
    redis: redis.Redis
    store: storage.ObjectStore


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
    svc = Services(
        config=config,
        db=db.connect(config.database_url, pool_size=20),
        celery=make_celery(config.redis_url),
        redis=redis.Redis.from_url(config.redis_url),
        store=storage.store_from_config(config),
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
        if "\x00" in request.path or "\x00" in request.query_string.decode("latin-1"):
            raise ValidationError("the URL contains a NUL character; remove it")
        if request.path in PUBLIC_PATHS:
            return
        with svc.db.connect() as conn:
            g.principal = tenants.authenticate(conn, request.headers.get("X-API-Key"))

    @app.errorhandler(TreadleError)
    def treadle_error(exc: TreadleError) -> Any:
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
        log.exception("unhandled error on %s %s", request.method, request.path)
        return jsonify(error={"code": "internal", "message": "internal server error"}), 500

    return app


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
