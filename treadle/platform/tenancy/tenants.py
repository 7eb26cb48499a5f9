"""Tenants, the calling principal and its roles.

Roles: the platform's `operator` (the key seeded from TREADLE_ADMIN_KEY; creates, lists,
disables and enables tenants, manages any tenant's keys, and uses the service as a member of
tenant `default`), a tenant's `admin` (manages its own tenant's keys) and `member` (uses the
service). Role checks live here, in the platform, so every caller gets them, not only the views.
Keys themselves are in `keys`. Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

import sqlalchemy as sa

from treadle.platform.errors import (
    AlreadyExistsError,
    NotFoundError,
    PermissionDeniedError,
    StateConflictError,
    ValidationError,
)
from treadle.platform.eventlog.schema import api_keys, tenants

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_TENANT_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
MAX_NAME = 128


class Role(StrEnum):
    OPERATOR = "operator"
    ADMIN = "admin"
    MEMBER = "member"


# The roles a key can be given through the API; operator keys are only seeded at startup.
GRANTABLE_ROLES = (Role.ADMIN, Role.MEMBER)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's id (the actor of every event it causes), its tenant, its role."""

    key_id: str
    tenant_id: str
    role: str

    @property
    def is_operator(self) -> bool:
        return self.role == Role.OPERATOR

    @property
    def is_admin(self) -> bool:
        """May manage its own tenant's keys (a tenant admin, or the operator)."""
        return self.role in (Role.ADMIN, Role.OPERATOR)


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    created_at: datetime
    disabled_at: datetime | None

    @property
    def is_disabled(self) -> bool:
        return self.disabled_at is not None


def require_operator(principal: Principal, action: str) -> None:
    """Refuse (403) anyone but the operator."""
    if not principal.is_operator:
        raise PermissionDeniedError(
            f"{action} needs the operator's key (the one TREADLE_ADMIN_KEY seeds); "
            f"this is a {principal.role} key of tenant {principal.tenant_id}"
        )


def require_tenant_admin(principal: Principal, tenant_id: str, action: str) -> None:
    """Refuse (403) anyone but an admin of `tenant_id` or the operator."""
    if principal.is_operator:
        return
    if principal.role != Role.ADMIN:
        raise PermissionDeniedError(
            f"{action} needs an admin key of the tenant; this is a {principal.role} key: "
            f"ask an admin of tenant {principal.tenant_id}"
        )
    if tenant_id != principal.tenant_id:
        raise PermissionDeniedError(
            f"{action}: an admin key manages its own tenant ({principal.tenant_id}) only; "
            "ask the operator to act on another tenant"
        )


def validate_tenant_id(tenant_id: str) -> None:
    if not _TENANT_ID.match(tenant_id):
        raise ValidationError(
            f"tenant id {tenant_id!r} is invalid: use 1-63 characters of a-z, 0-9, '_' or '-', "
            "starting with a letter or digit"
        )


def validate_name(name: str | None, what: str) -> None:
    if name is not None and not (1 <= len(name) <= MAX_NAME and name.isprintable()):
        raise ValidationError(
            f"{what} must be 1-{MAX_NAME} printable characters (no control characters)"
        )


def ensure_tenant(conn: sa.Connection, tenant_id: str, name: str | None = None) -> None:
    """Create the tenant unless it exists (for seeding at startup and tests; no role check)."""
    validate_tenant_id(tenant_id)
    stmt = sa.dialects.postgresql.insert(tenants).values(id=tenant_id, name=name or tenant_id)
    conn.execute(stmt.on_conflict_do_nothing(index_elements=["id"]))


def create_tenant(
    conn: sa.Connection, principal: Principal, tenant_id: str, name: str | None = None
) -> Tenant:
    """Create a tenant (operator only). One that exists is a 409, never touched."""
    require_operator(principal, "creating a tenant")
    validate_tenant_id(tenant_id)
    validate_name(name, "the tenant's name")
    stmt = sa.dialects.postgresql.insert(tenants).values(id=tenant_id, name=name or tenant_id)
    row = conn.execute(
        stmt.on_conflict_do_nothing(index_elements=["id"]).returning(*tenants.c)
    ).first()
    if row is None:
        raise AlreadyExistsError(
            f"tenant {tenant_id} exists already; nothing was created. To give it another key, "
            f"POST /api/v1/treadle/keys with tenant_id {tenant_id!r} (treadle keys create "
            f"--tenant {tenant_id})"
        )
    log.info("tenant %s created by %s", tenant_id, principal.key_id)
    return _tenant(row)


def get_tenant(conn: sa.Connection, tenant_id: str, *, for_update: bool = False) -> Tenant:
    query = sa.select(tenants).where(tenants.c.id == tenant_id)
    row = conn.execute(query.with_for_update() if for_update else query).first()
    if row is None:
        raise NotFoundError(
            f"no tenant {tenant_id!r}; list them with GET /api/v1/treadle/tenants "
            "(treadle tenants list)"
        )
    return _tenant(row)


def list_tenants(conn: sa.Connection, principal: Principal) -> list[Tenant]:
    require_operator(principal, "listing tenants")
    return [_tenant(r) for r in conn.execute(sa.select(tenants).order_by(tenants.c.id))]


def set_disabled(
    conn: sa.Connection, principal: Principal, tenant_id: str, disabled: bool
) -> Tenant:
    """Disable (or enable again) a tenant, operator only; a disabled tenant's keys are refused
    from their next request on. Idempotent. The tenant holding an operator key cannot be
    disabled: that would lock the operator out."""
    require_operator(principal, "disabling or enabling a tenant")
    tenant = get_tenant(conn, tenant_id, for_update=True)
    if disabled and _has_operator_key(conn, tenant_id):
        raise StateConflictError(
            f"tenant {tenant_id} holds the operator's key and cannot be disabled; "
            "revoke or disable other tenants instead"
        )
    if tenant.is_disabled == disabled:
        return tenant
    row = conn.execute(
        sa.update(tenants)
        .where(tenants.c.id == tenant_id)
        .values(disabled_at=sa.func.now() if disabled else None)
        .returning(*tenants.c)
    ).one()
    log.info(
        "tenant %s %s by %s", tenant_id, "disabled" if disabled else "enabled", principal.key_id
    )
    return _tenant(row)


def _has_operator_key(conn: sa.Connection, tenant_id: str) -> bool:
    return bool(
        conn.execute(
            sa.select(
                sa.exists().where(
                    api_keys.c.tenant_id == tenant_id,
                    api_keys.c.role == Role.OPERATOR,
                    api_keys.c.revoked_at.is_(None),
                )
            )
        ).scalar_one()
    )


def _tenant(row: sa.Row[tuple[object, ...]]) -> Tenant:
    return Tenant(id=row.id, name=row.name, created_at=row.created_at, disabled_at=row.disabled_at)
