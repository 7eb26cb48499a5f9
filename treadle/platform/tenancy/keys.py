"""API keys: minting, listing, revoking, and checking a presented key.

A key is `tml-<public id>-<secret>`: the public id names its row (key id `key-<public id>`), the
secret is 32 random bytes (urlsafe base64). Only the SHA-256 of the whole key is stored, so a key
is shown once, when it is minted; lookups go by key id with a constant-time comparison of the
hash (keys seeded from TREADLE_ADMIN_KEY, whose text the operator chose, by the hash's unique
index). The plaintext is never stored, logged or put in an error message. A key may also carry
an AWS-style access key pair for SigV4 (`access_keys`); listings show its id, never its secret.
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from treadle.platform.errors import (
    AuthenticationError,
    NotFoundError,
    PermissionDeniedError,
    StateConflictError,
    ValidationError,
)
from treadle.platform.eventlog.schema import api_keys, tenants
from treadle.platform.tenancy.tenants import (
    GRANTABLE_ROLES,
    Principal,
    Role,
    Tenant,
    create_tenant,
    ensure_tenant,
    get_tenant,
    require_tenant_admin,
    validate_name,
)

log = logging.getLogger(__name__)

PREFIX = "tml-"
SECRET_BYTES = 32
# `last_used_at` is refreshed when older than this, so authentication rarely writes.
LAST_USED_RESOLUTION = timedelta(minutes=1)
# Keys minted before roles existed had a 12-hex-digit public id; new ones have 16.
_MINTED = re.compile(r"^tml-([0-9a-f]{12}|[0-9a-f]{16})-(.+)$")


@dataclass(frozen=True)
class ApiKey:
    """A key as listed: never its hash, never its secret."""

    id: str
    tenant_id: str
    role: str
    name: str | None
    created_at: datetime
    created_by: str | None
    last_used_at: datetime | None
    revoked_at: datetime | None
    revoked_by: str | None
    # The access key id of a key minted with an AWS-style pair (tenancy/access_keys), else None.
    access_key_id: str | None = None


@dataclass(frozen=True)
class NewKey:
    """A key just minted. `plaintext` is shown to the caller once and exists nowhere else."""

    key: ApiKey
    plaintext: str = field(repr=False)


@dataclass(frozen=True)
class NewTenant:
    tenant: Tenant
    admin: NewKey


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def seed_key(conn: sa.Connection, tenant_id: str, plaintext: str, role: str) -> str:
    """Register a key whose text the operator chose (TREADLE_ADMIN_KEY) with `role`, upgrading
    the row's role if it exists. A revoked key stays revoked. Returns its key id."""
    if not plaintext.startswith(PREFIX) or len(plaintext) < 12:
        raise ValidationError(
            "an API key must start with 'tml-' and have at least 8 characters after it "
            "(the tinker SDK refuses other keys)"
        )
    ensure_tenant(conn, tenant_id)
    key_hash = hash_key(plaintext)
    key_id = "key-" + key_hash[:12]
    stmt = sa.dialects.postgresql.insert(api_keys).values(
        id=key_id, tenant_id=tenant_id, secret_hash=key_hash, role=role, name="seeded"
    )
    row = conn.execute(
        stmt.on_conflict_do_update(index_elements=["id"], set_={"role": role}).returning(
            api_keys.c.revoked_at
        )
    ).one()
    if row.revoked_at is not None:
        log.warning(
            "the seeded %s key %s is revoked and stays refused; set TREADLE_ADMIN_KEY to a new "
            "tml- key and restart",
            role,
            key_id,
        )
    return key_id


def create_key(
    conn: sa.Connection,
    principal: Principal,
    tenant_id: str | None = None,
    role: str = Role.MEMBER,
    name: str | None = None,
) -> NewKey:
    """Mint a key for a tenant (the caller's by default): an admin for its own tenant, the
    operator for any. Operator keys are never minted here."""
    tenant_id = tenant_id or principal.tenant_id
    require_tenant_admin(principal, tenant_id, "creating a key")
    if role not in GRANTABLE_ROLES:
        raise ValidationError(
            f"role must be one of {', '.join(GRANTABLE_ROLES)}, got {role!r}; operator keys are "
            "only seeded from TREADLE_ADMIN_KEY at startup"
        )
    validate_name(name, "the key's name")
    tenant = get_tenant(conn, tenant_id)
    if tenant.is_disabled:
        raise StateConflictError(
            f"tenant {tenant_id} is disabled, so a new key would be refused; "
            f"enable it first (treadle tenants enable {tenant_id})"
        )
    new = mint_key(conn, tenant_id, role, name, created_by=principal.key_id)
    log.info(
        "key %s (%s) of tenant %s created by %s", new.key.id, role, tenant_id, principal.key_id
    )
    return new


def mint_key(
    conn: sa.Connection,
    tenant_id: str,
    role: str = Role.MEMBER,
    name: str | None = None,
    *,
    created_by: str | None = None,
) -> NewKey:
    """Mint a key with no role check (for `create_key` once it checked, seeding and tests)."""
    public_id = secrets.token_hex(8)
    plaintext = f"{PREFIX}{public_id}-{secrets.token_urlsafe(SECRET_BYTES)}"
    row = conn.execute(
        api_keys.insert()
        .values(
            id="key-" + public_id,
            tenant_id=tenant_id,
            secret_hash=hash_key(plaintext),
            role=role,
            name=name,
            created_by=created_by,
        )
        .returning(*api_keys.c)
    ).one()
    return NewKey(api_key_from_row(row), plaintext)


def create_tenant_key(
    conn: sa.Connection, tenant_id: str, role: str = Role.MEMBER
) -> tuple[str, str]:
    """Create the tenant if needed and mint a key, with no role check (seeding and tests; the
    API goes through `create_key`). Returns (key id, plaintext)."""
    ensure_tenant(conn, tenant_id)
    new = mint_key(conn, tenant_id, role)
    return new.key.id, new.plaintext


def open_tenant(
    conn: sa.Connection, principal: Principal, tenant_id: str, name: str | None = None
) -> NewTenant:
    """Create a tenant and its first admin key (operator only; an existing tenant is a 409)."""
    tenant = create_tenant(conn, principal, tenant_id, name)
    return NewTenant(tenant, create_key(conn, principal, tenant.id, Role.ADMIN, "first admin"))


def list_keys(
    conn: sa.Connection, principal: Principal, tenant_id: str | None = None
) -> list[ApiKey]:
    """A tenant's keys (the caller's by default), revoked ones included, oldest first."""
    tenant_id = tenant_id or principal.tenant_id
    require_tenant_admin(principal, tenant_id, "listing keys")
    get_tenant(conn, tenant_id)
    rows = conn.execute(
        sa.select(api_keys)
        .where(api_keys.c.tenant_id == tenant_id)
        .order_by(api_keys.c.created_at, api_keys.c.id)
    )
    return [api_key_from_row(r) for r in rows]


def get_key(conn: sa.Connection, principal: Principal, key_id: str) -> ApiKey:
    """One key: a key may read itself, an admin its tenant's keys, the operator any."""
    if key_id != principal.key_id:
        require_tenant_admin(principal, principal.tenant_id, "reading another key")
    return api_key_from_row(_scoped_row(conn, principal, key_id))


def revoke_key(conn: sa.Connection, principal: Principal, key_id: str) -> ApiKey:
    """Revoke a key (idempotent): a key may revoke itself, an admin its tenant's keys, the
    operator any key. The last operator key cannot be revoked."""
    if key_id != principal.key_id:
        require_tenant_admin(principal, principal.tenant_id, "revoking another key")
    row = _scoped_row(conn, principal, key_id)
    if row.revoked_at is not None:
        return api_key_from_row(row)
    if row.role == Role.OPERATOR:
        if not principal.is_operator:
            raise PermissionDeniedError(f"only the operator may revoke operator key {key_id}")
        _refuse_last_operator_key(conn, key_id)
    revoked = conn.execute(
        sa.update(api_keys)
        .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
        .values(revoked_at=sa.func.now(), revoked_by=principal.key_id)
        .returning(*api_keys.c)
    ).first()
    if revoked is None:  # revoked concurrently
        return api_key_from_row(_scoped_row(conn, principal, key_id))
    log.info("key %s of tenant %s revoked by %s", key_id, row.tenant_id, principal.key_id)
    return api_key_from_row(revoked)


def authenticate(conn: sa.Connection, plaintext: str | None) -> Principal:
    """The principal a presented key stands for: 401 for a missing, unknown or revoked key, 403
    when its tenant is disabled. Refreshes `last_used_at` when it is older than a minute (the
    caller commits)."""
    if not plaintext:
        raise AuthenticationError("missing API key: send it in the X-API-Key header")
    presented = hash_key(plaintext)
    row = _find(conn, plaintext, presented)
    if row is None:
        raise AuthenticationError(
            "unknown API key: check X-API-Key (keys start with 'tml-'); ask your tenant's admin "
            "for a new one"
        )
    if row.revoked_at is not None:
        raise AuthenticationError(
            f"API key {row.id} was revoked; ask your tenant's admin for a new key"
        )
    if row.disabled_at is not None:
        raise PermissionDeniedError(
            f"tenant {row.tenant_id} is disabled: its keys are refused until the operator "
            "enables it again"
        )
    mark_used(conn, row)
    return Principal(key_id=row.id, tenant_id=row.tenant_id, role=row.role)


def mark_used(conn: sa.Connection, row: Any) -> None:
    """Refresh the key's `last_used_at` when it is older than LAST_USED_RESOLUTION. `row` has
    the key's `id`, `last_used_at` and the database's `now`."""
    if row.last_used_at is None or row.last_used_at < row.now - LAST_USED_RESOLUTION:
        conn.execute(
            sa.update(api_keys)
            .where(
                api_keys.c.id == row.id,
                sa.or_(
                    api_keys.c.last_used_at.is_(None),
                    api_keys.c.last_used_at < sa.func.now() - LAST_USED_RESOLUTION,
                ),
            )
            .values(last_used_at=sa.func.now())
        )


def _find(conn: sa.Connection, plaintext: str, presented: str) -> Any:
    """The key's row joined with its tenant's disabled_at: by public id and a constant-time
    hash comparison when the key has a minted key's shape, else (a seeded key) by hash."""
    query = sa.select(
        api_keys.c.id,
        api_keys.c.tenant_id,
        api_keys.c.role,
        api_keys.c.secret_hash,
        api_keys.c.revoked_at,
        api_keys.c.last_used_at,
        tenants.c.disabled_at,
        sa.func.now().label("now"),
    ).join(tenants, tenants.c.id == api_keys.c.tenant_id)
    minted = _MINTED.match(plaintext)
    if minted is not None:
        row = conn.execute(query.where(api_keys.c.id == "key-" + minted.group(1))).first()
        if row is not None and hmac.compare_digest(row.secret_hash, presented):
            return row
    return conn.execute(query.where(api_keys.c.secret_hash == presented)).first()


def _scoped_row(conn: sa.Connection, principal: Principal, key_id: str) -> Any:
    """The key's row, if the caller's tenant owns it (any tenant for the operator). Another
    tenant's key answers exactly like a missing one."""
    query = sa.select(api_keys).where(api_keys.c.id == key_id)
    if not principal.is_operator:
        query = query.where(api_keys.c.tenant_id == principal.tenant_id)
    row = conn.execute(query).first()
    if row is None:
        raise NotFoundError(
            f"no API key {key_id!r}; list your tenant's keys with GET /api/v1/treadle/keys "
            "(treadle keys list)"
        )
    return row


def _refuse_last_operator_key(conn: sa.Connection, key_id: str) -> None:
    # Lock every live operator key (in id order), so two revocations cannot both pass.
    live = conn.execute(
        sa.select(api_keys.c.id)
        .where(api_keys.c.role == Role.OPERATOR, api_keys.c.revoked_at.is_(None))
        .order_by(api_keys.c.id)
        .with_for_update()
    ).scalars()
    if not any(k != key_id for k in live):
        raise StateConflictError(
            f"key {key_id} is the last operator key and cannot be revoked: set "
            "TREADLE_ADMIN_KEY to a new tml- key, restart the API (it seeds that key as "
            "operator), then revoke this one"
        )


def api_key_from_row(row: Any) -> ApiKey:
    """An `api_keys` row as listed: never its hash nor its secret's ciphertext."""
    return ApiKey(
        id=row.id,
        tenant_id=row.tenant_id,
        role=row.role,
        name=row.name,
        created_at=row.created_at,
        created_by=row.created_by,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
        revoked_by=row.revoked_by,
        access_key_id=row.access_key_id,
    )
