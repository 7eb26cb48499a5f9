"""The API in process (`create_app(config).test_client()`) against a real PostgreSQL and Redis,
for the security and billing tests: a database of its own on the run's server, so nothing it
creates can reach the served platform's workers, and a worker that is only a heartbeat row
(sessions can be created; their operations stay pending, which is all these tests need).
The session-scoped fixture `secure` (tests/conftest.py) runs one for the whole test run."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from cryptography.fernet import Fernet
from flask import Flask
from flask.testing import FlaskClient

from tests.databases import private_database
from treadle.api.app import create_app
from treadle.api.context import Services
from treadle.platform import db
from treadle.platform.config import PlatformConfig
from treadle.platform.sessions import leases

FAKE_WORKER = "worker-security"


@dataclass
class SecureApp:
    app: Flask
    operator_key: str  # the key `treadle up` would seed (TREADLE_ADMIN_KEY)
    database_url: str
    redis_url: str
    engine: sa.Engine
    data_dir: Path

    def client(self) -> FlaskClient:
        return self.app.test_client()

    def call(self, method: str, path: str, key: str | None, **kwargs: Any) -> Any:
        """One request with `key` (X-API-Key), as the SDK sends it."""
        headers = dict(kwargs.pop("headers", {}))
        if key is not None:
            headers["X-API-Key"] = key
        return self.client().open(path, method=method, headers=headers, **kwargs)

    def event_count(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM events")).scalar_one())

    def keep_worker_alive(self) -> None:
        with self.engine.begin() as conn:
            leases.heartbeat_worker(conn, FAKE_WORKER, {})


@contextlib.contextmanager
def running_secure_app(services: Any) -> Iterator[SecureApp]:
    with private_database(services.database_url, "treadle_security") as database_url:
        redis_url = services.redis_url.rsplit("/", 1)[0] + "/7"
        data_dir = Path(tempfile.mkdtemp(prefix="treadle-security-"))
        operator_key = "tml-operator-" + secrets.token_hex(8)
        config = PlatformConfig(
            database_url=database_url,
            redis_url=redis_url,
            data_dir=data_dir,
            admin_key=operator_key,
            secrets_key=Fernet.generate_key().decode(),  # access key pairs can be minted
            long_poll_seconds=0.5,
            lease_ttl_seconds=24 * 3600,  # the fake worker's one heartbeat keeps it alive
        )
        app = create_app(config)
        engine = db.connect(database_url, pool_size=2)
        secure_app = SecureApp(app, operator_key, database_url, redis_url, engine, data_dir)
        secure_app.keep_worker_alive()
        try:
            yield secure_app
        finally:
            svc: Services = app.extensions["treadle"]
            svc.close()
            engine.dispose()
            shutil.rmtree(data_dir, ignore_errors=True)
