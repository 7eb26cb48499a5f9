"""Tenants and API keys.

A key is `tml-<key id>-<secret>`; only its SHA-256 is stored, so a key is shown once. Every key
belongs to a tenant and has a role (`admin` or `member`). Imports nothing from api, gpu_worker or
torch.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

import sqlalchemy as sa

from treadle.platform.errors import AuthenticationError, ValidationError
from treadle.platform.schema import api_keys, tenants

DEFAULT_TENANT = "default"
ROLES = ("admin", "member")
_TENANT_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's id, its tenant and its role."""

    key_id: str
    tenant_id: str
    role: str

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def ensure_tenant(conn: sa.Connection, tenant_id: str, name: str | None = None) -> None:
    if not _TENANT_ID.match(tenant_id):
        raise ValidationError(
            f"tenant id {tenant_id!r} is invalid: use 1-63 characters of a-z, 0-9, '_' or '-', "
            "starting with a letter or digit"
        )
    stmt = sa.dialects.postgresql.insert(tenants).values(id=tenant_id, name=name or tenant_id)
    conn.execute(stmt.on_conflict_do_nothing(index_elements=["id"]))


def seed_key(conn: sa.Connection, tenant_id: str, plaintext: str, role: str) -> str:
    """Register a key whose plaintext the operator chose (e.g. TREADLE_ADMIN_KEY). Idempotent."""
    if not plaintext.startswith("tml-") or len(plaintext) < 12:
        raise ValidationError(
            "an API key must start with 'tml-' and have at least 8 characters after it "
            "(the tinker SDK refuses other keys)"
        )
    ensure_tenant(conn, tenant_id)
    key_hash = hash_key(plaintext)
    key_id = "key-" + key_hash[:12]
    stmt = sa.dialects.postgresql.insert(api_keys).values(
        id=key_id, tenant_id=tenant_id, secret_hash=key_hash, role=role
    )
    conn.execute(stmt.on_conflict_do_nothing(index_elements=["id"]))
    return key_id


def create_key(conn: sa.Connection, tenant_id: str, role: str = "member") -> tuple[str, str]:
    """Mint a new key for a tenant; returns (key id, plaintext). The plaintext is not stored."""
    if role not in ROLES:
        raise ValidationError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    ensure_tenant(conn, tenant_id)
    key_id = "key-" + secrets.token_hex(6)
    plaintext = f"tml-{key_id[4:]}-{secrets.token_urlsafe(24)}"
    conn.execute(
        api_keys.insert().values(
            id=key_id, tenant_id=tenant_id, secret_hash=hash_key(plaintext), role=role
        )
    )
    return key_id, plaintext


def authenticate(conn: sa.Connection, plaintext: str | None) -> Principal:
    if not plaintext:
        raise AuthenticationError("missing API key: send it in the X-API-Key header")
    row = conn.execute(
        sa.select(api_keys.c.id, api_keys.c.tenant_id, api_keys.c.role).where(
            api_keys.c.secret_hash == hash_key(plaintext), api_keys.c.revoked_at.is_(None)
        )
    ).first()
    if row is None:
        raise AuthenticationError("unknown or revoked API key")
    return Principal(key_id=row.id, tenant_id=row.tenant_id, role=row.role)
