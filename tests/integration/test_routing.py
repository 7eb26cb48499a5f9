"""Routing over a real Redis: a wake-up is a Celery message on its session's queue, and the
broker channel keeps one Redis client for its publishes and acks (kombu would build one per
command), replacing it when its connection pool is replaced."""

from __future__ import annotations

import base64
import json
import secrets

import pytest
import redis

from tests.conftest import Services
from treadle.platform.sessions import routing

pytestmark = pytest.mark.integration


def test_a_wake_up_is_a_celery_message_on_its_session_queue(services: Services) -> None:
    session_id = f"sess-{secrets.token_hex(4)}:train:0"
    app = routing.make_celery(services.redis_url)
    queue = routing.session_queue(session_id)
    client = redis.Redis.from_url(services.redis_url)
    try:
        routing.wake(app, session_id, "req-1")
        routing.wake(app, session_id, None)
        sent = [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]
        assert [m["headers"]["task"] for m in sent] == [routing.WAKE_TASK] * 2
        assert [m["headers"]["argsrepr"] for m in sent] == [
            repr([session_id, "req-1"]),
            repr([session_id, None]),
        ]
        assert [m["headers"]["kwargsrepr"] for m in sent] == ["{}", "{}"]
        bodies = [json.loads(base64.b64decode(m["body"])) for m in sent]
        assert [b[0] for b in bodies] == [[session_id, "req-1"], [session_id, None]]
        assert [b[1] for b in bodies] == [{}, {}]
    finally:
        client.delete(queue)
        client.close()
        app.close()


def test_the_broker_channel_keeps_one_client_until_its_pool_is_replaced(
    services: Services,
) -> None:
    app = routing.make_celery(services.redis_url)
    try:
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            first = channel._create_client()
            assert channel._create_client() is first
            assert first.connection_pool is channel.pool
            assert first.ping()
            # The channel drops its pools after a fork (kombu's after-fork hook does this).
            channel._disconnect_pools()
            second = channel._create_client()
            assert second is not first
            assert second.connection_pool is channel.pool
            assert second.ping()
            assert channel._create_client(asynchronous=True) is not second  # the consumer's own
    finally:
        app.close()


def test_a_url_kombu_parses_itself_keeps_kombus_transport() -> None:
    app = routing.make_celery("rediss://127.0.0.1:6380/0")
    assert not app.conf.broker_transport
    app.close()
