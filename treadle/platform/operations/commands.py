"""Platform commands: what a request asks of the platform, each in one place with its
dependencies passed in explicitly, so the API's views only parse, call one and serialise.

- `open_session`: create a training or sampling session (refused while no worker is alive to
  host it), lease it to a live worker, and admit its first operation.
- `submit`: admit an operation (`OperationRequested` and its row in one transaction), then wake
  the session's worker; each admission is counted and logged (`oplog`), a refusal logged.
- `stop_session`, `finish_client_session`: stop, fail what was pending, tell the worker, notify
  whoever waits.
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kombu.exceptions
import redis
import sqlalchemy as sa
from celery import Celery

from treadle.platform import metrics
from treadle.platform.billing import quotas
from treadle.platform.config import PlatformConfig
from treadle.platform.errors import TreadleError, UnavailableError, ValidationError
from treadle.platform.eventlog import notify, oplog, schema
from treadle.platform.eventlog.optypes import Payload
from treadle.platform.operations import cancellation, operations
from treadle.platform.sessions import admission, leases, routing
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.tenancy.tenants import Principal

log = logging.getLogger(__name__)

# A worker restarted by `treadle up` heartbeats within seconds.
NO_WORKER_RETRY_SECONDS = 10


@dataclass(frozen=True)
class Deps:
    """What the commands use: the database, the broker, the notice channel, the settings and
    the request-rate limiter (None: no rate limits)."""

    db: sa.Engine
    celery: Celery
    redis: redis.Redis
    config: PlatformConfig
    rate_limiter: quotas.RateLimiter | None = None


def submit(
    deps: Deps,
    principal: Principal,
    session_id: str,
    seq_id: int | Callable[[sa.Connection], int],
    payload: Payload,
    *,
    sampler_id: str | None = None,
    with_request: Callable[[sa.Connection, operations.Admission], None] | None = None,
    on_admitted: Callable[[operations.Admission], None] | None = None,
) -> operations.Admission:
    """Append the request (then `with_request` with the new admission, in the same
    transaction), then wake its worker.
    `on_admitted` sees a new request's id before the commit, so before any worker can run it
    (`progress.want_progress` marks a streamed sample there).

    The request is in the log once this commits; a wake-up that cannot be sent (the broker is
    down) is only logged: the worker's lease keeper re-wakes operations left pending. The
    tenant's quota (request rate, reservation) is read in the same transaction, on the same
    connection. `seq_id` may be a function that allocates one in that transaction (a sampler
    whose seq_ids the server gives out: `sessions.next_sampler_seq`).
    """
    seq: int | None = None if callable(seq_id) else seq_id

    def logged(outcome: str, request_id: str | None, error_code: str | None = None) -> None:
        oplog.operation(request_id=request_id, session_id=session_id,
                        tenant_id=principal.tenant_id, type=payload.TYPE, seq_id=seq,
                        outcome=outcome, error_code=error_code)  # fmt: skip

    try:
        limiter = deps.rate_limiter

        def rate_limit(quota: quotas.Quota) -> None:
            if limiter is not None:
                limiter.check(principal.tenant_id, quota.requests_per_second)

        with deps.db.begin() as conn:
            if callable(seq_id):
                seq = seq_id(conn)
            assert seq is not None
            admission = operations.admit(
                conn,
                principal,
                session_id,
                seq,
                payload,
                sampler_id=sampler_id,
                metering=deps.config.metering,
                on_quota=rate_limit,
            )
            if admission.is_new and with_request is not None:
                with_request(conn, admission)
            if admission.is_new and on_admitted is not None:
                on_admitted(admission)
    except TreadleError as exc:
        if not isinstance(exc, UnavailableError):  # a 503 did not answer; anything else refused
            logged("refused", None, exc.code)
        raise
    logged("admitted" if admission.is_new else "duplicate", admission.request_id)
    if admission.is_new:
        metrics.ADMITTED.labels(payload.TYPE).inc()
        try:
            routing.wake(deps.celery, session_id, admission.request_id)
        except Exception as exc:  # the log is the truth; the wake-up is a hint
            log.warning("could not wake %s for %s: %s", session_id, admission.request_id, exc)
    return admission


def open_session(
    deps: Deps,
    principal: Principal,
    *,
    session_id: str,
    client_session_id: str,
    kind: str,
    base_model: str,
    first: Payload | None = None,
    with_session: Callable[[sa.Connection], None] | None = None,
    **fields: Any,
) -> operations.Admission | None:
    """Create a session of the caller's client session, lease it to a live worker and admit
    `first` as its seq 0 (None for a sampling session). `with_session` runs in the creating
    transaction; `fields` are `sessions.create_session`'s (name, lora_config, ...).

    Raises UnavailableError (before creating anything) while no live worker can host `base_model`.
    """
    with deps.db.begin() as conn:
        sessions_core.require_running_client_session(conn, principal, client_session_id)
        need = admission.Held(session_id, base_model, kind, dict(fields.get("lora_config") or {}))
        require_host(conn, deps.config, base_model, need)
        if (
            deps.config.metering
            and kind in sessions_core.ADAPTER_KINDS
            and not _exists(conn, session_id)
        ):
            quotas.check_session_slot(conn, principal.tenant_id)  # a resend takes no new slot
        sessions_core.create_session(
            conn,
            principal,
            session_id=session_id,
            client_session_id=client_session_id,
            kind=kind,
            base_model=base_model,
            **fields,
        )
        if with_session is not None:
            with_session(conn)
        # Leased in the creating transaction: a session committed unleased would go to whichever
        # worker's lease keeper saw it first, not to the least loaded one.
        worker_id = leases.place_session(
            conn, session_id, deps.config.lease_ttl_seconds, base_model, need
        )
    if worker_id is not None:
        consume(deps, worker_id, session_id)
    return None if first is None else submit(deps, principal, session_id, 0, first)


def _exists(conn: sa.Connection, session_id: str) -> bool:
    return conn.execute(sa.select(schema.sessions.c.id).where(
        schema.sessions.c.id == session_id)).first() is not None  # fmt: skip


def require_host(
    conn: sa.Connection, config: PlatformConfig, base_model: str, need: admission.Held | None = None
) -> None:
    """Refuse to create a session on `base_model` while no live worker can host it: a 503
    while none is alive (a worker is on its way, the SDK retries), a 400 naming each live
    worker's reason (its files, its memory) while none of them can load the model, and, given
    `need` (the new session as admission counts it), a 400 naming the numbers while every live
    worker that can load the model lacks the memory for it beside the sessions it holds."""
    able, reasons = leases.hosts(conn, config.lease_ttl_seconds, base_model)
    if able and need is not None:
        roomy, full = leases.with_room(conn, able, need)
        if not roomy:
            info = conn.execute(
                sa.select(schema.workers.c.info).where(schema.workers.c.id == able[0])
            ).scalar()
            why = "; ".join(f"{reason}" for _, reason in sorted(full.items()))
            raise ValidationError(
                f"no live worker has the memory for {admission.need_words(info, need)}: {why}. "
                "Lower the rank, train fewer targets (train_unembed=False, train_mlp=False), "
                "stop sessions you no longer need, or ask the operator for a worker with more "
                "memory (TREADLE_WORKER_MODEL_MEMORY, a bigger device)"
            )
    if able:
        return
    if reasons:
        why = "; ".join(f"{worker}: {reason}" for worker, reason in sorted(reasons.items()))
        raise ValidationError(
            f"no live worker can hold base model {base_model} ({why}); the operator starts a "
            "worker that can (the model's files readable at its path, memory for its weights), "
            "or choose another model"
        )
    if not leases.live_workers(conn, config.lease_ttl_seconds):
        raise UnavailableError(
            f"no worker is alive (none heartbeated in the last {config.lease_ttl_seconds:g} s) "
            "to host a new session; start one (`treadle worker`, or `treadle up`, which restarts "
            f"dead workers) and retry in {NO_WORKER_RETRY_SECONDS} s",
            retry_after=NO_WORKER_RETRY_SECONDS,
        )


def consume(deps: Deps, worker_id: str, session_id: str) -> None:
    """Have a new session's holder consume its queue.

    The lease is the truth: a consume request that cannot be sent (the broker is down) is only
    logged, since the holder's lease keeper starts consuming its sessions' queues by itself.
    """
    try:
        routing.start_consuming(deps.celery, worker_id, session_id)
    except kombu.exceptions.OperationalError as exc:
        log.warning("could not ask %s to consume %s: %s", worker_id, session_id, exc)


def stop_session(deps: Deps, principal: Principal, session_id: str) -> None:
    """Stop a session: `SessionStopped`, its pending operations failed, its worker told."""
    with deps.db.begin() as conn:
        stopped = sessions_core.stop_session(conn, principal, session_id, "stopped by client")
        failed = cancellation.fail_pending(
            conn, session_id, f"model {session_id} was stopped", actor=principal.key_id
        )
    _after_stop(deps, [session_id] if stopped else [], failed)


def finish_client_session(
    deps: Deps, principal: Principal, client_session_id: str, reason: str
) -> list[str]:
    """Finish a client session and stop every session it opened; returns the stopped ids."""
    with deps.db.begin() as conn:
        stopped = sessions_core.finish_client_session(conn, principal, client_session_id, reason)
        failed = [
            request_id
            for session_id in stopped
            for request_id in cancellation.fail_pending(
                conn,
                session_id,
                f"session {client_session_id} was finished",
                actor=principal.key_id,
            )
        ]
    _after_stop(deps, stopped, failed)
    return stopped


def _after_stop(deps: Deps, stopped: list[str], failed: list[str]) -> None:
    for session_id in stopped:
        try:
            routing.request_stop(deps.celery, session_id)
        except kombu.exceptions.OperationalError as exc:  # its worker sees the status anyway
            log.warning("could not send the stop of %s: %s", session_id, exc)
    for request_id in failed:
        notify.publish_done(deps.redis, request_id)
