"""Completion notices over Redis pub/sub, so a long-polled future returns within milliseconds.

The worker publishes after its settlement commits; the API subscribes before it reads the
database, so a notice can never slip between the read and the wait.
Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import redis

T = TypeVar("T")


def channel(request_id: str) -> str:
    return f"treadle:done:{request_id}"


def publish_done(client: redis.Redis, request_id: str) -> None:
    client.publish(channel(request_id), b"1")


def wait_until(
    client: redis.Redis, request_id: str, check: Callable[[], T | None], timeout: float
) -> T | None:
    """Return `check()` once it is not None, waiting for a completion notice up to `timeout`."""
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        pubsub.subscribe(channel(request_id))
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value is not None:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            # Re-check at least every second: a notice is an optimisation, the database the truth.
            pubsub.get_message(timeout=min(remaining, 1.0))
    finally:
        pubsub.close()
