"""The operator's view of the running platform (`treadle status`): the workers (heartbeat age,
alive or not by the lease TTL, sessions held, queue depth, metrics address, device, and memory
per device as admission adds it up: capacity, held by base models and by sessions, the working
set, free), the base models in service (parameters, bytes, which live workers can host each),
live sessions per tenant, and the pending operations with the oldest of them.

Three read-only statements (the workers, the sessions they hold for the memory budget, the
rest), so the view costs the database little however often an operator or a script polls it.
Ages are computed by PostgreSQL from its own clock, the one heartbeats are written with.
Operator only.
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.eventlog.schema import operations, sessions, workers
from treadle.platform.models import registry
from treadle.platform.sessions import admission
from treadle.platform.sessions.leases import unable_to_host
from treadle.platform.sessions.sessions import ACTIVE_STATUSES
from treadle.platform.tenancy.tenants import Principal, require_operator


@dataclass(frozen=True)
class WorkerStatus:
    id: str
    heartbeat_age_seconds: float
    is_alive: bool  # heartbeated within the lease TTL: it keeps its sessions and gets new ones
    sessions: int  # active sessions leased to it
    queued: int  # pending operations of those sessions
    metrics_url: str | None  # its Prometheus endpoint, from its heartbeat, when it serves one
    device: str | None  # where it runs its models ("cpu", "cuda:0"), from its heartbeat
    world_size: int  # its ranks: a worker group runs each session on all of them
    layout: str | None  # a group's: "replicated" or "sharded" base models (None: one process)
    # Its memory per device as admission adds it up (`admission.Budget.as_dict`: capacity, held
    # by base models, by sessions' adapters, the working set, free); None: it reports no budget.
    memory: dict[str, Any] | None = None


@dataclass(frozen=True)
class ModelStatus:
    name: str
    parameters: int
    size_bytes: int
    hosts: list[str]  # the live workers that can load it (files present, memory enough)


@dataclass(frozen=True)
class PendingOperation:
    request_id: str
    session_id: str
    tenant_id: str
    type: str
    seq_id: int
    age_seconds: float


@dataclass(frozen=True)
class PlatformStatus:
    lease_ttl_seconds: float
    workers: list[WorkerStatus]
    models: list[ModelStatus]
    live_sessions: dict[str, int]  # tenant id -> its active sessions (tenants with none left out)
    pending_operations: int
    oldest_pending: PendingOperation | None


def read_status(
    conn: sa.Connection, principal: Principal, lease_ttl_seconds: float
) -> PlatformStatus:
    """The platform's state now. Raises PermissionDeniedError (403) for anyone but the operator."""
    require_operator(principal, "the platform's status")
    rows = conn.execute(_workers_query()).all()
    live = [row for row in rows if float(row.age) < lease_ttl_seconds]
    held = admission.held_by(conn, [row.id for row in rows])
    budgets = {row.id: admission.budget(row.id, row.info or {}, held[row.id]) for row in rows}
    return PlatformStatus(
        lease_ttl_seconds=lease_ttl_seconds,
        workers=[
            WorkerStatus(
                id=row.id,
                heartbeat_age_seconds=max(0.0, float(row.age)),
                is_alive=float(row.age) < lease_ttl_seconds,
                sessions=row.sessions,
                queued=row.queued,
                metrics_url=_text_or_none((row.info or {}).get("metrics_url")),
                device=_text_or_none((row.info or {}).get("device")),
                world_size=int((row.info or {}).get("world_size", 1)),
                layout=_text_or_none((row.info or {}).get("layout")),
                memory=None if (b := budgets[row.id]) is None else b.as_dict(),
            )
            for row in rows
        ],
        models=[
            ModelStatus(
                name=m.info.name,
                parameters=m.info.parameters,
                size_bytes=m.info.size_bytes,
                hosts=[r.id for r in live if unable_to_host(r.info or {}, m.info.name) is None],
            )
            for m in registry.list_models(conn)
        ],
        **_summary(conn),
    )


def _age(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    return sa.func.extract("epoch", sa.func.now() - column)


def _workers_query() -> sa.Select[Any]:
    held = (
        sa.select(sa.func.count())
        .where(sessions.c.worker_id == workers.c.id, sessions.c.status.in_(ACTIVE_STATUSES))
        .scalar_subquery()
    )
    queued = (
        sa.select(sa.func.count())
        .select_from(operations.join(sessions, operations.c.session_id == sessions.c.id))
        .where(sessions.c.worker_id == workers.c.id, operations.c.status == OpStatus.PENDING)
        .scalar_subquery()
    )
    return sa.select(
        workers.c.id,
        workers.c.info,
        _age(workers.c.heartbeat_at).label("age"),
        held.label("sessions"),
        queued.label("queued"),
    ).order_by(workers.c.id)


def _summary(conn: sa.Connection) -> dict[str, Any]:
    """Live sessions per tenant, the pending count and the oldest pending operation, in one
    statement (each part a subquery PostgreSQL folds into JSON)."""
    per_tenant = (
        sa.select(sessions.c.tenant_id, sa.func.count().label("n"))
        .where(sessions.c.status.in_(ACTIVE_STATUSES))
        .group_by(sessions.c.tenant_id)
        .subquery()
    )
    live = sa.select(sa.func.jsonb_object_agg(per_tenant.c.tenant_id, per_tenant.c.n))
    pending = sa.select(sa.func.count()).where(operations.c.status == OpStatus.PENDING)
    fields: dict[str, sa.ColumnElement[Any]] = {
        "request_id": operations.c.request_id,
        "session_id": operations.c.session_id,
        "tenant_id": operations.c.tenant_id,
        "type": operations.c.type,
        "seq_id": operations.c.seq_id,
        "age_seconds": _age(operations.c.created_at),
    }
    oldest = (
        sa.select(sa.func.jsonb_build_object(*(x for pair in fields.items() for x in pair)))
        .where(operations.c.status == OpStatus.PENDING)
        .order_by(operations.c.created_at, operations.c.request_position)
        .limit(1)
    )
    row = conn.execute(
        sa.select(
            live.scalar_subquery().label("live"),
            pending.scalar_subquery().label("pending"),
            oldest.scalar_subquery().label("oldest"),
        )
    ).one()
    found = row.oldest
    return {
        "live_sessions": {tenant: int(n) for tenant, n in sorted((row.live or {}).items())},
        "pending_operations": int(row.pending),
        "oldest_pending": None
        if found is None
        else PendingOperation(
            request_id=found["request_id"],
            session_id=found["session_id"],
            tenant_id=found["tenant_id"],
            type=found["type"],
            seq_id=int(found["seq_id"]),
            age_seconds=max(0.0, float(found["age_seconds"])),
        ),
    }


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
