"""Request accessors: the app's services, the calling principal, the JSON body, query arguments.

The route modules import these (never `app.py`); only the app factory imports the routes.
Imports platform only; never torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from celery import Celery
from flask import current_app, g, request
from redis import Redis

from treadle.api import body
from treadle.platform import db
from treadle.platform.billing import quotas
from treadle.platform.checkpoints import storage
from treadle.platform.config import PlatformConfig
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import notify
from treadle.platform.models import registry
from treadle.platform.operations import commands
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.tenancy import tenants

# How long a client should wait after a dependency failed (the Retry-After header). The tinker
# SDK's ordinary requests honour it (up to 60 s; tinker/_base_client.py _calculate_retry_timeout).
RETRY_AFTER_SECONDS = 5
# Sessions whose base model an API process remembers (`base_model_of`); past this it starts over.
MAX_REMEMBERED_SESSIONS = 100_000


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
    rate_limiter: quotas.RateLimiter
    models: registry.ModelRegistry  # the base models, built-in and registered
    # (tenant id, session id) -> base model, for sessions this process has seen (`base_model_of`)
    base_models: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def deps(self) -> commands.Deps:
        """What the platform's commands need."""
        return commands.Deps(
            db=self.db,
            celery=self.celery,
            redis=self.redis,
            config=self.config,
            rate_limiter=self.rate_limiter,
        )

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


def base_model_of(session_id: str) -> str:
    """The base model of the caller's session `session_id` (NotFoundError, a 404, for a missing
    or another tenant's one). A session's base model never changes, so each API process reads it
    once per session, not on every training request; its status and lease are read where they
    matter, in the admission's transaction."""
    svc, who = services(), principal()
    key = (who.tenant_id, session_id)
    base_model = svc.base_models.get(key)
    if base_model is None:
        with db.reading(svc.db) as conn:
            base_model = sessions_core.get_session(conn, who, session_id).base_model
        if len(svc.base_models) >= MAX_REMEMBERED_SESSIONS:
            svc.base_models.clear()
        svc.base_models[key] = base_model
    return base_model


def json_body() -> Any:
    """The request's JSON body (None when empty), read within the limits `body` enforces."""
    return body.read_json(request)


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
