"""Flask app factory: builds the process's services, registers the route blueprints, the
authentication hook and the error handlers (`errors`).

Views live in the `routes_*` blueprints; they parse, call a platform command and serialise, and
reach the services through `context`, never through this module.
Imports platform only; never torch, engine or worker.
"""

from __future__ import annotations

import time

import redis
import sqlalchemy as sa
from flask import Flask, g, request
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from treadle.api import auth, errors, routes_docs, routes_metrics, telemetry
from treadle.api.anthropic import routes as routes_anthropic
from treadle.api.context import Services
from treadle.api.openai import routes as routes_openai
from treadle.api.sagemaker import routes as routes_sagemaker
from treadle.api.tinker import routes_billing as routes_tinker_billing
from treadle.api.tinker import (
    routes_checkpoint_sharing,
    routes_checkpoints,
    routes_futures,
    routes_hf,
    routes_sampling,
    routes_sessions,
    routes_training,
)
from treadle.api.tinker import routes_client_sessions as routes_tinker_sessions
from treadle.api.tinker import routes_custom_losses as routes_tinker_custom_losses
from treadle.api.tinker import routes_extras as routes_tinker_extras
from treadle.api.tinker import routes_futures_extra as routes_tinker_futures
from treadle.api.treadle import (
    routes_admin,
    routes_billing,
    routes_lineage,
    routes_models,
    routes_status,
)
from treadle.api.treadle import routes_extensions as routes_treadle
from treadle.platform import db
from treadle.platform.billing import prices, quotas
from treadle.platform.checkpoints import storage
from treadle.platform.config import PlatformConfig
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import notify
from treadle.platform.models import registry
from treadle.platform.sessions.routing import make_celery

# /metrics: Prometheus scrapes without a key (serve the API where only operators reach it).
PUBLIC_PATHS = ("/healthz", "/api/v1/healthz", "/api/v1/openapi.json", "/metrics")
# A trace download link carries its own secret token (routes_tinker_sessions.download_trace);
# /hf/ serves public tokenizer files to hub clients, which send no X-API-Key (routes_hf);
# an external weights download link carries its own token too (routes_checkpoint_sharing).
PUBLIC_PREFIXES = ("/api/v1/treadle/traces/", "/hf/", "/api/v1/treadle/downloads/")
# OpenAI clients send the key as `Authorization: Bearer`; Anthropic clients as `x-api-key` (the
# X-API-Key header every route reads) or as a bearer token (`auth_token=`, and anthropic 2.x).
OAI_PREFIX = "/oai/api/v1"
OAI_BLUEPRINT = "oai"
BEARER_PREFIXES = ("/v1/", f"{OAI_PREFIX}/", "/anthropic/api/v1/")
CONNECT_TIMEOUT_SECONDS = 3
# An answer later than the long-poll by this much is logged as slow (telemetry.install).
SLOW_ANSWER_MARGIN_SECONDS = 10.0


def create_app(config: PlatformConfig) -> Flask:
    app = Flask("treadle", static_folder=None)  # no /static route: nothing is served from disk
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes  # larger bodies are a 413
    client = redis.Redis.from_url(
        config.redis_url,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        socket_timeout=10,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 2),
    )
    main_db = db.connect(_fail_fast(config.database_url), pool_size=20)
    svc = Services(
        config=config,
        db=main_db,
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
        rate_limiter=quotas.RateLimiter(client),
        models=registry.ModelRegistry(main_db),
    )
    app.extensions["treadle"] = svc
    with svc.db.begin() as conn:  # prices of models that have none yet
        prices.load_defaults(conn, config.prices_file or prices.DEFAULT_PRICES_FILE)
    auth.install(app, svc.db, config.admin_key)

    for module in (
        routes_sessions,
        routes_training,
        routes_checkpoints,
        routes_sampling,
        routes_futures,
        routes_treadle,
        routes_lineage,
        routes_docs,
        routes_admin,
        routes_models,
        routes_billing,
        routes_tinker_billing,
        routes_tinker_sessions,
        routes_hf,
        routes_checkpoint_sharing,
        routes_tinker_futures,
        routes_tinker_extras,
        routes_tinker_custom_losses,
        routes_status,
        routes_metrics,
        routes_openai,
        routes_anthropic,
        routes_sagemaker,
    ):
        app.register_blueprint(module.bp)
    # Tinker's documented OpenAI-compatible path: the same views, hook and error handler again.
    app.register_blueprint(routes_openai.bp, url_prefix=OAI_PREFIX, name=OAI_BLUEPRINT)

    # First of the request hooks: its clock starts before the others'.
    telemetry.install(app, slow_after=config.long_poll_seconds + SLOW_ANSWER_MARGIN_SECONDS)

    @app.before_request
    def authenticate() -> None:
        g.started = time.monotonic()
        if "\x00" in request.path or any(
            "\x00" in text for key, values in request.args.lists() for text in (key, *values)
        ):
            raise ValidationError("the URL contains a NUL character; remove it")
        if request.path in PUBLIC_PATHS or request.path.startswith(PUBLIC_PREFIXES):
            return
        if request.blueprint == routes_sagemaker.bp.name:
            return  # signed with SigV4: the blueprint checks its own signatures
        key = request.headers.get("X-API-Key")
        if key is None and request.path.startswith(BEARER_PREFIXES):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            key = token.strip() if scheme.lower() == "bearer" else None
        g.principal = auth.authenticate(key)

    errors.register(app, svc)
    return app


def _fail_fast(database_url: str) -> str:
    """The database URL with a short connect timeout (unless it names one), so a request fails
    within seconds, not minutes, when PostgreSQL's host cannot be reached."""
    url = sa.make_url(db.sqlalchemy_url(database_url))
    if "connect_timeout" not in url.query:
        url = url.update_query_dict({"connect_timeout": str(CONNECT_TIMEOUT_SECONDS)})
    return url.render_as_string(hide_password=False)
