"""What an OpenAI-compatible request's `model` names, and the sampler that serves it.

`model` is (a) a live training session of the caller's tenant (its newest weights saved for the
sampler), (b) a `tinker://<run>/sampler_weights/<name>` checkpoint the caller may read, or (c) a
catalogue base model; anything else, another tenant's included, is a 404 like a missing one.
Each (tenant, model, weights) gets a sampler of its own, so its seq_ids are allocated here, in the
database (`next_seq`), and never collide with a tinker client's. Checkpoints and base models are
served by a sampling session in the tenant's OpenAI client session (one per tenant, tagged
OPENAI_TAG, heartbeated by every request). Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import sqlalchemy as sa

from treadle.platform.checkpoints import checkpoints, publishing
from treadle.platform.errors import NotFoundError, ValidationError
from treadle.platform.eventlog.schema import client_sessions, samplers, sessions
from treadle.platform.models import registry
from treadle.platform.operations import commands
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.sessions.sessions import ClientSessionStatus, SessionKind
from treadle.platform.tenancy.tenants import Principal

OPENAI_TAG = "treadle:openai"
CHECKPOINT_SCHEME = "tinker://"


@dataclass(frozen=True)
class Target:
    """What serves `model`: the session that samples, its weights, and the model's id."""

    model: str
    base_model: str
    session_id: str | None  # a live training session's id; None: a sampling session of ours
    snapshot_id: str | None
    checkpoint_prefix: str | None


def model_not_found(model: str) -> NotFoundError:
    return NotFoundError(
        f"the model {model!r} does not exist or you do not have access to it; GET /v1/models "
        "lists the models you can use"
    )


def resolve(conn: sa.Connection, principal: Principal, model: str) -> Target:
    """The caller's `model`; NotFoundError (404) for a missing or another tenant's one,
    ValidationError (400) for a session with no sampler weights or a non-sampler checkpoint."""
    if model.startswith(CHECKPOINT_SCHEME):
        try:
            checkpoint = publishing.get_readable(conn, principal, model)
        except (NotFoundError, ValidationError):
            raise model_not_found(model) from None
        if checkpoint.path.kind != "sampler_weights" or checkpoint.is_merged:
            raise ValidationError(
                f"{model} is not a sampler checkpoint; save one with save_weights_for_sampler"
                "(name) (without merge_weights) and use its tinker://.../sampler_weights/... path"
            )
        base = sessions_core.get_session(conn, None, checkpoint.session_id).base_model
        return Target(model, base, None, f"checkpoint:{checkpoint.path}", checkpoint.storage_prefix)
    if any(m.info.name == model for m in registry.list_models(conn)):
        return Target(model, model, None, None, None)
    try:
        session = sessions_core.get_session(conn, principal, model)
    except NotFoundError:
        raise model_not_found(model) from None
    if session.kind not in sessions_core.ADAPTER_KINDS:
        raise model_not_found(model)
    if not session.is_active:  # nothing would run its samples
        raise ValidationError(
            f"model {model} is {session.status.lower()}; use one of its sampler checkpoints "
            "(tinker://.../sampler_weights/..., listed by GET /v1/models) instead"
        )
    newest = conn.execute(
        sa.select(samplers.c.snapshot_id)
        .where(
            samplers.c.session_id == session.id,
            samplers.c.tenant_id == principal.tenant_id,
            samplers.c.snapshot_id.is_not(None),
            ~samplers.c.id.like(f"{session.id}:openai:%"),
            ~samplers.c.id.like(f"{session.id}:sagemaker:%"),  # a package's: not a snapshot
        )
        .order_by(samplers.c.created_at.desc())
        .limit(1)
    ).scalar_one_or_none()
    if newest is None:
        raise ValidationError(
            f"model {model} has no weights saved for sampling; call save_weights_for_sampler "
            "(or save_weights_and_get_sampling_client) on it first"
        )
    return Target(model, session.base_model, session.id, str(newest), None)


def sampler_for(deps: commands.Deps, principal: Principal, target: Target) -> tuple[str, str]:
    """(sampler id, session id) serving `target`, created on first use."""
    if target.session_id is not None:  # a training session samples its own snapshots
        sampler = f"{target.session_id}:openai:{_digest(str(target.snapshot_id))}"
        with deps.db.begin() as conn:
            session = sessions_core.get_session(conn, principal, target.session_id)
            sessions_core.create_sampler(
                conn, principal, sampler=sampler, client_session_id=session.client_session_id,
                session_id=session.id, base_model=target.base_model,
                snapshot_id=target.snapshot_id,
            )  # fmt: skip
        return sampler, target.session_id
    client_session = _client_session(deps.db, principal)
    sampler, active = _current_sampler(deps.db, f"{client_session}:openai:{_digest(target.model)}")
    if not active:

        def with_sampler(conn: sa.Connection) -> None:
            sessions_core.create_sampler(
                conn, principal, sampler=sampler, client_session_id=client_session,
                session_id=sampler, base_model=target.base_model,
                snapshot_id=target.snapshot_id,
                model_path=target.model if target.checkpoint_prefix else None,
                checkpoint_prefix=target.checkpoint_prefix,
            )  # fmt: skip

        commands.open_session(
            deps, principal, session_id=sampler, client_session_id=client_session,
            kind=SessionKind.SAMPLING, base_model=target.base_model, with_session=with_sampler,
        )  # fmt: skip
    return sampler, sampler


def _current_sampler(db: sa.Engine, base: str) -> tuple[str, bool]:
    """The id of the sampling session serving `base` now, and whether it is active. One that
    stopped (stopped by its tenant, failed) is followed by generation `<base>:<k>`; concurrent
    first requests compute the same id, and opening a session twice opens it once."""
    named = sa.or_(sessions.c.id == base, sessions.c.id.startswith(f"{base}:", autoescape=True))
    with db.connect() as conn:
        rows = conn.execute(sa.select(sessions.c.id, sessions.c.status).where(named)).all()
    status = {row.id: row.status for row in rows}
    newest = base if len(status) <= 1 else f"{base}:{len(status) - 1}"
    if status.get(newest) in sessions_core.ACTIVE_STATUSES:
        return newest, True
    return (base if not status else f"{base}:{len(status)}"), False


def _client_session(db: sa.Engine, principal: Principal) -> str:
    """The tenant's running OpenAI client session (created if it has none), heartbeated."""
    with db.begin() as conn:
        # one creator per tenant at a time: concurrent first requests share one client session
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_lock_key(principal.tenant_id))))
        found = conn.execute(
            sa.update(client_sessions)
            .where(
                client_sessions.c.tenant_id == principal.tenant_id,
                client_sessions.c.status == ClientSessionStatus.RUNNING,
                client_sessions.c.tags.contains([OPENAI_TAG]),
            )
            .values(heartbeat_at=sa.func.now())
            .returning(client_sessions.c.id)
        ).scalars()
        ids = sorted(found)
        if ids:
            return ids[0]
        return sessions_core.create_client_session(
            conn, principal, [OPENAI_TAG], {}, display_name="OpenAI-compatible routes"
        )


def listed(conn: sa.Connection, principal: Principal) -> list[tuple[str, str]]:
    """(model id, owner) of every model the caller may use: base models, its live training
    sessions with sampler weights, its sampler checkpoints."""
    models = [(m.info.name, "treadle") for m in registry.list_models(conn)]
    live = conn.execute(
        sa.select(sessions.c.id)
        .where(
            sessions.c.tenant_id == principal.tenant_id,
            sessions.c.kind.in_(sessions_core.ADAPTER_KINDS),
            sessions.c.status.in_(sessions_core.ACTIVE_STATUSES),
            sa.exists().where(
                samplers.c.session_id == sessions.c.id, samplers.c.snapshot_id.is_not(None)
            ),
        )
        .order_by(sessions.c.created_at, sessions.c.id)
    ).scalars()
    models += [(session_id, principal.tenant_id) for session_id in live]
    saved, _ = checkpoints.list_for(conn, principal)
    models += [
        (str(c.path), principal.tenant_id)
        for c in saved
        if c.path.kind == "sampler_weights" and not c.is_merged
    ]
    return models


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _lock_key(tenant_id: str) -> int:
    """A signed 64-bit advisory lock key for the tenant's OpenAI client session."""
    return int.from_bytes(
        hashlib.sha256(f"openai:{tenant_id}".encode()).digest()[:8], "big", signed=True
    )


__all__ = [
    "OPENAI_TAG",
    "Target",
    "listed",
    "model_not_found",
    "resolve",
    "sampler_for",
]
