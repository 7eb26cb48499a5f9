"""Checkpoints: `tinker://` paths, names, storage prefixes and the versioned registry.

A checkpoint is addressed as `tinker://<run id>/weights/<name>` (adapter + optimizer state,
resumable), `tinker://<run id>/sampler_weights/<name>` (weights for sampling, optionally merged
into a full model) or `tinker://<run id>/external_weights/<name>` (a PEFT adapter folder for use
outside Treadle). Its files live under the tenant's storage prefix, built here and never taken
from input. Each save is a new version of a model package group. Every lookup is tenant-scoped:
another tenant's checkpoint answers like a missing one. Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import distinct_on

from treadle.platform.checkpoints import storage
from treadle.platform.errors import NotFoundError, ValidationError
from treadle.platform.eventlog.schema import checkpoints, sessions
from treadle.platform.tenancy.tenants import Principal

KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
_RUN_ID = re.compile(r"^sess-[0-9a-f]{16}:train:\d+$")
MAX_NAME = 128


@dataclass(frozen=True)
class CheckpointPath:
    run_id: str
    kind: str  # "weights" | "sampler_weights" | "external_weights"
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"


@dataclass(frozen=True)
class Checkpoint:
    path: CheckpointPath
    tenant_id: str
    session_id: str
    storage_prefix: str
    model_package_group: str
    version: int
    size_bytes: int
    has_optimizer: bool
    is_merged: bool
    created_at: datetime
    expires_at: datetime | None
    public: bool = False  # published: readable by every tenant's keys (platform.publishing)
    description: str | None = None  # what the save said of itself

    def to_json(self) -> dict[str, Any]:
        """The Tinker REST shape of a checkpoint, plus Treadle's registry fields."""
        return {
            "checkpoint_id": self.path.checkpoint_id,
            "checkpoint_type": KINDS[self.path.kind],
            "time": self.created_at.isoformat(),
            "tinker_path": str(self.path),
            "size_bytes": self.size_bytes,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
            "public": self.public,
            "model_package_group": self.model_package_group,
            "version": self.version,
            "has_optimizer": self.has_optimizer,
            "is_merged": self.is_merged,
        }


def storage_prefix(tenant_id: str, path: CheckpointPath) -> str:
    """Where checkpoint `path`'s files live: under its tenant's prefix, built, never taken from
    input."""
    return storage.tenant_key(tenant_id, "sessions", path.run_id, path.kind, path.name)


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValidationError("a checkpoint name must be a non-empty string")
    if len(name) > MAX_NAME:
        raise ValidationError(f"checkpoint name has {len(name)} characters; use at most {MAX_NAME}")
    if "/" in name or "\\" in name or "\x00" in name or name in (".", "..") or ".." in name:
        raise ValidationError(
            f"checkpoint name {name!r} may not contain '/', '\\', '..' or NUL; use letters, "
            "digits, '-', '_' and '.'"
        )
    if any(ord(c) < 32 for c in name):
        raise ValidationError("checkpoint name may not contain control characters")
    return name


def parse_path(path: str) -> CheckpointPath:
    """Parse `tinker://<run id>/<weights|sampler_weights>/<name>` strictly."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise ValidationError(
            f"{path!r} is not a checkpoint path; expected tinker://<run id>/weights/<name>"
        )
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3:
        raise ValidationError(
            f"{path!r} must have exactly three parts: tinker://<run id>/<weights|sampler_weights>/<name>"
        )
    run_id, kind, name = parts
    if kind not in KINDS:
        raise ValidationError(
            f"{path!r}: the kind must be 'weights', 'sampler_weights' or 'external_weights', "
            f"got {kind!r}"
        )
    if not _RUN_ID.match(run_id):
        raise NotFoundError(f"checkpoint {path} not found")
    return CheckpointPath(run_id, kind, validate_name(name))


def register(
    conn: sa.Connection,
    *,
    tenant_id: str,
    path: CheckpointPath,
    storage_prefix: str,
    size_bytes: int,
    has_optimizer: bool,
    is_merged: bool,
    ttl_seconds: int | None,
    description: str | None = None,
) -> Checkpoint:
    """Record a saved checkpoint as the next version of its session's model package group.

    Saving under an existing path replaces it (the previous version stays in the history, deleted).
    """
    session = conn.execute(
        sa.select(sessions.c.model_package_group, sessions.c.name).where(
            sessions.c.id == path.run_id
        )
    ).one()
    group = session.model_package_group or session.name or path.run_id
    conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(f"{tenant_id}/{group}"))))
    version = (
        conn.execute(
            sa.select(sa.func.max(checkpoints.c.version)).where(
                checkpoints.c.tenant_id == tenant_id, checkpoints.c.model_package_group == group
            )
        ).scalar_one_or_none()
        or 0
    ) + 1
    conn.execute(
        sa.update(checkpoints)
        .where(checkpoints.c.tinker_path == str(path), checkpoints.c.deleted_at.is_(None))
        .values(deleted_at=sa.func.now())
    )
    expires = (
        sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, ttl_seconds)
        if ttl_seconds
        else None
    )
    conn.execute(
        checkpoints.insert().values(
            tenant_id=tenant_id,
            session_id=path.run_id,
            kind=path.kind,
            name=path.name,
            tinker_path=str(path),
            storage_prefix=storage_prefix,
            model_package_group=group,
            version=version,
            size_bytes=size_bytes,
            has_optimizer=has_optimizer,
            is_merged=is_merged,
            expires_at=expires,
            description=description,
        )
    )
    return get(conn, None, str(path), tenant_id=tenant_id)


def _live(query: sa.Select[Any]) -> sa.Select[Any]:
    return query.where(
        checkpoints.c.deleted_at.is_(None),
        sa.or_(checkpoints.c.expires_at.is_(None), checkpoints.c.expires_at > sa.func.now()),
    )


def get(
    conn: sa.Connection,
    principal: Principal | None,
    path: str,
    *,
    tenant_id: str | None = None,
    readable: bool = False,
) -> Checkpoint:
    """The live checkpoint at `path` of the caller's tenant (with `readable`, also another
    tenant's published one: see platform.publishing); NotFoundError otherwise."""
    parsed = parse_path(path)
    tenant = principal.tenant_id if principal is not None else tenant_id
    query = _live(sa.select(checkpoints).where(checkpoints.c.tinker_path == str(parsed)))
    if tenant is not None:
        owned = checkpoints.c.tenant_id == tenant
        query = query.where(
            sa.or_(owned, checkpoints.c.published_at.is_not(None)) if readable else owned
        )
    row = conn.execute(query).first()
    if row is None:
        raise NotFoundError(f"checkpoint {parsed} not found")
    return checkpoint_of(row)


def list_for(
    conn: sa.Connection,
    principal: Principal,
    *,
    run_id: str | None = None,
    group: str | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> tuple[list[Checkpoint], int]:
    """The tenant's live checkpoints, oldest first (one page of them), and how many there are."""
    query = _live(sa.select(checkpoints).where(checkpoints.c.tenant_id == principal.tenant_id))
    if run_id is not None:
        query = query.where(checkpoints.c.session_id == run_id)
    if group is not None:
        query = query.where(checkpoints.c.model_package_group == group)
    total = conn.execute(sa.select(sa.func.count()).select_from(query.subquery())).scalar_one()
    page = query.order_by(checkpoints.c.created_at, checkpoints.c.id).offset(offset).limit(limit)
    return [checkpoint_of(r) for r in conn.execute(page)], int(total)


def exists(conn: sa.Connection, principal: Principal, path: CheckpointPath) -> bool:
    query = _live(
        sa.select(checkpoints.c.id).where(
            checkpoints.c.tenant_id == principal.tenant_id,
            checkpoints.c.tinker_path == str(path),
        )
    )
    return conn.execute(query).first() is not None


def latest_for(
    conn: sa.Connection, principal: Principal, run_ids: list[str]
) -> dict[str, Checkpoint]:
    """Each run's newest live checkpoint, in one query."""
    if not run_ids:
        return {}
    rows = conn.execute(
        _live(
            sa.select(checkpoints)
            .ext(distinct_on(checkpoints.c.session_id))
            .where(checkpoints.c.tenant_id == principal.tenant_id)
            .where(checkpoints.c.session_id.in_(run_ids))
        ).order_by(
            checkpoints.c.session_id, checkpoints.c.created_at.desc(), checkpoints.c.id.desc()
        )
    )
    return {r.session_id: checkpoint_of(r) for r in rows}


def delete(conn: sa.Connection, principal: Principal, path: str) -> Checkpoint:
    checkpoint = get(conn, principal, path)
    conn.execute(
        sa.update(checkpoints)
        .where(
            checkpoints.c.tinker_path == str(checkpoint.path), checkpoints.c.deleted_at.is_(None)
        )
        .values(deleted_at=sa.func.now())
    )
    return checkpoint


def set_ttl(
    conn: sa.Connection, principal: Principal, path: str, ttl_seconds: int | None
) -> Checkpoint:
    checkpoint = get(conn, principal, path)
    expires = (
        sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, ttl_seconds)
        if ttl_seconds
        else None
    )
    conn.execute(
        sa.update(checkpoints)
        .where(
            checkpoints.c.tinker_path == str(checkpoint.path), checkpoints.c.deleted_at.is_(None)
        )
        .values(expires_at=expires)
    )
    return get(conn, principal, path)


def checkpoint_of(row: sa.Row[Any]) -> Checkpoint:
    """A checkpoint from a row holding the `checkpoints` table's columns (among others)."""
    return Checkpoint(
        path=CheckpointPath(row.session_id, row.kind, row.name),
        tenant_id=row.tenant_id,
        session_id=row.session_id,
        storage_prefix=row.storage_prefix,
        model_package_group=row.model_package_group,
        version=row.version,
        size_bytes=row.size_bytes,
        has_optimizer=row.has_optimizer,
        is_merged=row.is_merged,
        created_at=row.created_at,
        expires_at=row.expires_at,
        public=row.published_at is not None,
        description=row.description,
    )


def reap_expired(conn: sa.Connection, limit: int = 20) -> list[Checkpoint]:
    """Mark checkpoints whose TTL has passed as deleted; returns them so their files can go."""
    rows = conn.execute(
        sa.select(checkpoints)
        .where(checkpoints.c.deleted_at.is_(None), checkpoints.c.expires_at <= sa.func.now())
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    if rows:
        conn.execute(
            sa.update(checkpoints)
            .where(checkpoints.c.id.in_([r.id for r in rows]))
            .values(deleted_at=sa.func.now())
        )
    return [checkpoint_of(r) for r in rows]
