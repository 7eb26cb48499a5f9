"""A stack for the degradation tests: the module's own embedded PostgreSQL and Redis, which its
tests stop and start, and helpers to drive `create_app` in process against it (a worker there is
a heartbeat row whose operations the test settles by hand)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from flask.testing import FlaskClient
from tinker import types

from tests.integration.wire_client import datum
from treadle.platform.embedded import EmbeddedPostgres, EmbeddedRedis
from treadle.platform.eventlog import notify
from treadle.platform.operations import operations
from treadle.platform.sessions import leases
from treadle.platform.sessions import sessions as sessions_core

KEY = "tml-degrade-" + secrets.token_hex(8)
WORKER = "worker-degrade"
BASE_MODEL = "treadle/tiny-debug"


@dataclass
class Stack:
    """This module's own PostgreSQL and Redis, which its tests stop and start."""

    root: Path
    postgres: EmbeddedPostgres
    redis: EmbeddedRedis
    database_url: str
    redis_url: str
    engine: sa.Engine

    @contextlib.contextmanager
    def down(self, server: EmbeddedPostgres | EmbeddedRedis) -> Iterator[None]:
        """Stop `server` for the block; it comes back on the same URL."""
        server.stop()
        try:
            yield
        finally:
            server.start()

    def set_workers(self, *worker_ids: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM workers"))
            for worker_id in worker_ids:
                leases.heartbeat_worker(conn, worker_id, {})

    def settle(self, request_id: str, result: dict[str, Any], *, carry: bool = False) -> None:
        """Complete an operation as the worker holding its session would (its notice carrying
        the outcome if `carry`, as a worker's does)."""
        with self.engine.begin() as conn:
            op = operations.get_operation(conn, None, request_id)
            session = sessions_core.get_session(conn, None, op.session_id)
            assert session.worker_id == WORKER, session
            operations.settle(
                conn, op, worker_id=WORKER, lease_epoch=session.lease_epoch,
                result=result, error=None, usage={},
            )  # fmt: skip
        outcome = (
            operations.outcome_notice(op.type, result, None, max_bytes=notify.MAX_OUTCOME_BYTES)
            if carry
            else None
        )
        with redis.Redis.from_url(self.redis_url) as client:
            notify.publish_done(client, request_id, outcome)


def post(client: FlaskClient, path: str, body: dict[str, Any]) -> Any:
    response = client.post(f"/api/v1/{path}", json=body, headers={"X-API-Key": KEY})
    assert response.status_code == 200, response.get_data(as_text=True)
    return response.get_json()


def create_model(client: FlaskClient, session_id: str, model_seq_id: int = 0) -> dict[str, Any]:
    body = {"session_id": session_id, "model_seq_id": model_seq_id, "base_model": BASE_MODEL,
            "lora_config": {"rank": 4}}  # fmt: skip
    return post(client, "create_model", body)  # type: ignore[no-any-return]


def fb_proto(model_id: str, seq_id: int) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum([1, 2, 3, 4])], loss_fn="cross_entropy"
        ),
    )
    return forward_backward_request_to_proto(request).SerializeToString()
