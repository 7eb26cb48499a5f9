"""The API's WSGI entry for production servers: `gunicorn treadle.api.wsgi:app` (compose.yaml).

An entry point: builds the process's PlatformConfig from the environment once, sets up the log
output from it, and builds `app` with `create_app(config)`. gunicorn imports this module in each
worker process after the fork (never with --preload: database pools, Redis clients and the
notice listener's thread do not survive a fork). Settings and hooks are in `gunicorn_conf`.
`treadle up` serves the same app through waitress and does not import this module.
Imports platform and api only; never torch, engine or worker.
"""

from __future__ import annotations

from flask import Flask

from treadle.api.app import create_app
from treadle.platform import logs
from treadle.platform.config import PlatformConfig


def build(config: PlatformConfig) -> Flask:
    """The WSGI app for `config`, which must name the platform's PostgreSQL and Redis: unlike
    `treadle up`, a WSGI server starts no embedded ones."""
    missing = [
        name
        for name, value in (("DATABASE_URL", config.database_url), ("REDIS_URL", config.redis_url))
        if not value
    ]
    if missing:
        raise RuntimeError(
            f"treadle.api.wsgi needs {' and '.join(missing)}: set them to the platform's "
            "PostgreSQL (postgresql://user:password@host:5432/db) and Redis "
            "(redis://:password@host:6379/0), and run `treadle migrate` once first; "
            "`treadle up` is the command that runs embedded servers"
        )
    logs.configure(config.log_format)
    return create_app(config)


config = PlatformConfig.from_env()
app = build(config)
