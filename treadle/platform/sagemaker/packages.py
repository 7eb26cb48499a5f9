"""SageMaker's model registry over Treadle's checkpoints: a model package group is a checkpoint
group of the tenant (`checkpoints.model_package_group`), a package is one live checkpoint, its
version the group's version number the checkpoint registry gave it.

Every save of a session registers the next version of the session's group: `saveState` (a
training checkpoint, adapter and optimizer: `IsCheckpoint`), `saveWeights` (weights for
sampling, or a merged model); a Tinker client's saves in the same group are versions too. A
group exists once a row names it (CreateModelPackageGroup, or the first SageMaker session that
names it) or a checkpoint is in it. Deleting a package deletes its checkpoint (the caller then
deletes its files). Every lookup is scoped to the caller's tenant; another tenant's group or
package answers like a missing one. Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from treadle.platform.checkpoints import checkpoints as registry
from treadle.platform.checkpoints.checkpoints import Checkpoint
from treadle.platform.errors import AlreadyExistsError, NotFoundError
from treadle.platform.eventlog.schema import checkpoints, model_package_groups, sessions
from treadle.platform.sagemaker.arns import PackageRef
from treadle.platform.tenancy.tenants import Principal


@dataclass(frozen=True)
class Group:
    name: str
    description: str | None
    created_at: datetime
    created_by: str | None


@dataclass(frozen=True)
class Package:
    checkpoint: Checkpoint
    base_model: str  # the base model of the session that saved it

    @property
    def is_checkpoint(self) -> bool:
        """A resumable training state (saveState), not weights for sampling."""
        return self.checkpoint.path.kind == "weights"


def ensure_group(conn: sa.Connection, principal: Principal, name: str) -> None:
    """Record group `name` of the caller's tenant if no row names it yet."""
    conn.execute(
        insert(model_package_groups)
        .values(tenant_id=principal.tenant_id, name=name, created_by=principal.key_id)
        .on_conflict_do_nothing()
    )


def create_group(
    conn: sa.Connection, principal: Principal, name: str, description: str | None
) -> Group:
    """CreateModelPackageGroup: AlreadyExistsError if the group exists already."""
    if _has_checkpoints(conn, principal, name):
        raise _exists(name)
    created = conn.execute(
        insert(model_package_groups)
        .values(
            tenant_id=principal.tenant_id,
            name=name,
            description=description,
            created_by=principal.key_id,
        )
        .on_conflict_do_nothing()
        .returning(model_package_groups.c.name)
    ).first()
    if created is None:
        raise _exists(name)
    return get_group(conn, principal, name)


def _exists(name: str) -> AlreadyExistsError:
    return AlreadyExistsError(f"model package group {name} already exists")


def get_group(conn: sa.Connection, principal: Principal, name: str) -> Group:
    row = conn.execute(
        sa.select(model_package_groups).where(
            model_package_groups.c.tenant_id == principal.tenant_id,
            model_package_groups.c.name == name,
        )
    ).first()
    if row is not None:
        return Group(row.name, row.description, row.created_at, row.created_by)
    first = conn.execute(  # a group only checkpoints name: as old as its first version
        sa.select(sa.func.min(checkpoints.c.created_at)).where(
            checkpoints.c.tenant_id == principal.tenant_id,
            checkpoints.c.model_package_group == name,
        )
    ).scalar_one_or_none()
    if first is None:
        raise NotFoundError(f"model package group {name} does not exist")
    return Group(name, None, first, None)


def _has_checkpoints(conn: sa.Connection, principal: Principal, name: str) -> bool:
    return (
        conn.execute(
            sa.select(checkpoints.c.id)
            .where(
                checkpoints.c.tenant_id == principal.tenant_id,
                checkpoints.c.model_package_group == name,
            )
            .limit(1)
        ).first()
        is not None
    )


_LIVE = (
    checkpoints.c.deleted_at.is_(None),
    sa.or_(checkpoints.c.expires_at.is_(None), checkpoints.c.expires_at > sa.func.now()),
)
_WITH_BASE = sa.select(checkpoints, sessions.c.base_model.label("saved_on")).join(
    sessions, sessions.c.id == checkpoints.c.session_id
)


def list_packages(
    conn: sa.Connection,
    principal: Principal,
    group: str,
    *,
    by_name: bool,
    descending: bool,
    created_after: datetime | None,
    created_before: datetime | None,
    offset: int,
    limit: int,
) -> tuple[list[Package], bool]:
    """One page of the group's live packages (by version or creation time, or by name, which
    for the versions of one group is the same order), and whether more follow."""
    del by_name  # every package of a group shares its name: version order is the only order
    query = _WITH_BASE.where(
        checkpoints.c.tenant_id == principal.tenant_id,
        checkpoints.c.model_package_group == group,
        *_LIVE,
    )
    if created_after is not None:
        query = query.where(checkpoints.c.created_at > created_after)
    if created_before is not None:
        query = query.where(checkpoints.c.created_at < created_before)
    order = checkpoints.c.version.desc() if descending else checkpoints.c.version
    rows = conn.execute(query.order_by(order).offset(offset).limit(limit + 1)).all()
    return [_package(r) for r in rows[:limit]], len(rows) > limit


def get_package(conn: sa.Connection, principal: Principal, ref: PackageRef) -> Package:
    """The caller's live package `ref`; NotFoundError ("does not exist", which the SageMaker SDK
    reads as already deleted) otherwise."""
    row = conn.execute(
        _WITH_BASE.where(
            checkpoints.c.tenant_id == principal.tenant_id,
            checkpoints.c.model_package_group == ref.group,
            checkpoints.c.version == ref.version,
            *_LIVE,
        )
    ).first()
    if row is None:
        raise NotFoundError(f"ModelPackage {ref.group}/{ref.version} does not exist.")
    return _package(row)


def delete_package(conn: sa.Connection, principal: Principal, ref: PackageRef) -> Package:
    """Delete a package: its checkpoint is deleted (the caller deletes its files after commit)."""
    package = get_package(conn, principal, ref)
    registry.delete(conn, principal, str(package.checkpoint.path))
    return package


def saved_as(conn: sa.Connection, principal: Principal, tinker_path: str) -> tuple[str, int]:
    """(group, version) a completed save at `tinker_path` registered, deleted since or not."""
    row = conn.execute(
        sa.select(checkpoints.c.model_package_group, checkpoints.c.version)
        .where(
            checkpoints.c.tenant_id == principal.tenant_id,
            checkpoints.c.tinker_path == tinker_path,
        )
        .order_by(checkpoints.c.id.desc())
        .limit(1)
    ).one()
    return str(row[0]), int(row[1])


def _package(row: Any) -> Package:
    return Package(registry.checkpoint_of(row), row.saved_on)
