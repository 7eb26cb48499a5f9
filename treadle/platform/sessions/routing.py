"""Routing: the Celery app, per-session queue names, wake-ups and consumer placement.

Celery messages are wake-ups only (session id + request id); the event log is the truth. Each
session's operations go to its own queue, consumed only by the worker holding its lease, with
`acks_late` and prefetch 1. Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Celery
from kombu.transport import redis as kombu_redis

DEFAULT_QUEUE = "treadle.default"
WAKE_TASK = "treadle.wake"
STOP_TASK = "treadle.stop"


def session_queue(session_id: str) -> str:
    return f"treadle.session.{session_id}"


class _Channel(kombu_redis.Channel):
    """kombu's Redis channel, keeping one client for its publishes and acks.

    kombu builds a new `redis.Redis` for each of them, and each build copies redis-py's table of
    about 170 response callbacks: a fifth of a wake-up's CPU in the API, and as much again in
    the worker for each message it receives (the unacked record) and acks. The client holds no
    connection of its own (each command borrows one from the channel's pool, as before), so one
    per channel serves all of them; a new pool (after a fork) gets a new client.
    """

    _kept: redis.Redis | None = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the consumer's own (BRPOP) client: kombu caches it already
            return super()._create_client(asynchronous=True)
        kept = self._kept
        if kept is None or kept.connection_pool is not self.pool:
            kept = self._kept = super()._create_client()
        return kept


class _Transport(kombu_redis.Transport):
    Channel = _Channel


def make_celery(redis_url: str) -> Celery:
    app = Celery("treadle", broker=redis_url, set_as_current=False)
    if urlsplit(redis_url).scheme == "redis":  # TLS and socket URLs keep kombu's own transport
        app.conf.broker_transport = f"{__name__}:_Transport"  # a name: the config stays plain
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=DEFAULT_QUEUE,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600},
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_serializer="json",
        accept_content=["json"],
    )
    return app


def wake(app: Celery, session_id: str, request_id: str | None) -> None:
    """Tell the session's worker that `request_id` is in the log (None: look at the session).
    Call only after commit."""
    args = [session_id, request_id]
    app.send_task(WAKE_TASK, args=args, queue=session_queue(session_id), **_reprs(args))


def request_stop(app: Celery, session_id: str) -> None:
    args = [session_id]
    app.send_task(STOP_TASK, args=args, queue=session_queue(session_id), **_reprs(args))


def _reprs(args: Sequence[str | None]) -> dict[str, str]:
    """The message's `argsrepr` and `kwargsrepr` headers (what logs and monitors show), written
    here: Celery's own go through its `saferepr`, about an eighth of a wake-up's CPU for two ids."""
    return {"argsrepr": repr(args), "kwargsrepr": "{}"}


def start_consuming(app: Celery, worker_id: str, session_id: str) -> None:
    """Ask a worker (by its Celery hostname) to consume a session's queue."""
    app.control.add_consumer(session_queue(session_id), destination=[worker_id], reply=False)


def stop_consuming(app: Celery, worker_id: str, session_id: str) -> None:
    app.control.cancel_consumer(session_queue(session_id), destination=[worker_id], reply=False)
