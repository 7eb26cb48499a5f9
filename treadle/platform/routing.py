"""Routing: the Celery app, per-session queue names, wake-ups and consumer placement.

Celery messages are wake-ups only (session id + request id); the event log is the truth. Each
session's operations go to its own queue, consumed only by the worker holding its lease, with
`acks_late` and prefetch 1. Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

from celery import Celery

DEFAULT_QUEUE = "treadle.default"
WAKE_TASK = "treadle.wake"
STOP_TASK = "treadle.stop"


def session_queue(session_id: str) -> str:
    return f"treadle.session.{session_id}"


def make_celery(redis_url: str) -> Celery:
    app = Celery("treadle", broker=redis_url, set_as_current=False)
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
    app.send_task(WAKE_TASK, args=[session_id, request_id], queue=session_queue(session_id))


def request_stop(app: Celery, session_id: str) -> None:
    app.send_task(STOP_TASK, args=[session_id], queue=session_queue(session_id))


def start_consuming(app: Celery, worker_id: str, session_id: str) -> None:
    """Ask a worker (by its Celery hostname) to consume a session's queue."""
    app.control.add_consumer(session_queue(session_id), destination=[worker_id], reply=False)


def stop_consuming(app: Celery, worker_id: str, session_id: str) -> None:
    app.control.cancel_consumer(session_queue(session_id), destination=[worker_id], reply=False)
