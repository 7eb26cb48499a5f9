"""Fixtures of the degradation tests (test_degrade.py, test_long_polls.py): the stack of
embedded servers they stop and start, and apps built on it."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask

from tests.integration.degraded import KEY, WORKER, Stack
from treadle.api.app import create_app as build_app
from treadle.api.context import Services
from treadle.platform import db
from treadle.platform.config import PlatformConfig
from treadle.platform.embedded import EmbeddedPostgres, EmbeddedRedis


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    root = Path(tempfile.mkdtemp(prefix="treadle-degrade-"))
    postgres, redis_server = EmbeddedPostgres(root / "postgres"), EmbeddedRedis(root / "redis")
    try:
        database_url = postgres.start()
        db.migrate(database_url)
        redis_url = redis_server.start()
        engine = db.connect(database_url, pool_size=2)
        yield Stack(root, postgres, redis_server, database_url, redis_url, engine)
        engine.dispose()
    finally:
        redis_server.stop()
        postgres.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_app(stack: Stack) -> Iterator[Callable[..., Flask]]:
    """Build apps on the stack (one live worker unless a test says otherwise); closed after."""
    built: list[Services] = []

    def make(**overrides: Any) -> Flask:
        config = PlatformConfig(
            database_url=stack.database_url, redis_url=stack.redis_url,
            data_dir=stack.root / "data", admin_key=KEY,
            long_poll_seconds=1.0, lease_ttl_seconds=60.0,
        )  # fmt: skip
        app = build_app(dataclasses.replace(config, **overrides))
        built.append(app.extensions["treadle"])
        return app

    stack.set_workers(WORKER)
    yield make
    for svc in built:
        svc.close()
