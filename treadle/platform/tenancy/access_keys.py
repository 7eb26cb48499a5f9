"""AWS-style access key pairs on API keys, for SigV4-signed requests (SageMaker's API).

A pair is minted together with an ordinary API key (one `api_keys` row: the same tenant, role
and revocation), so one mint gives both forms: the `tml-` key for X-API-Key, and an access key
id (20 uppercase letters and digits, like AWS's) with a 40-character secret access key. SigV4 is
symmetric, so the server needs the secret itself: it is stored only encrypted (Fernet, under the
operator's TREADLE_SECRETS_KEY; several comma-separated keys rotate: the first encrypts, all
decrypt), shown once when minted, and never logged, listed or put in an error message.
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import logging
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import sqlalchemy as sa
from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from treadle.platform.config import SECRETS_KEY_HOWTO
from treadle.platform.errors import AuthenticationError, PermissionDeniedError, StateConflictError
from treadle.platform.eventlog.schema import api_keys, tenants
from treadle.platform.tenancy import keys
from treadle.platform.tenancy.tenants import Principal, Role, require_tenant_admin

log = logging.getLogger(__name__)

# Treadle's access key ids start with this, so an operator tells them from AWS's (AKIA...).
ACCESS_KEY_PREFIX = "TRDL"
ACCESS_KEY_ID_LENGTH = 20
SECRET_LENGTH = 40
_ID_ALPHABET = string.ascii_uppercase + string.digits
# Letters and digits only (AWS's also use '+' and '/'): the pair pastes into any shell or .env.
_SECRET_ALPHABET = string.ascii_letters + string.digits
ACCESS_KEY_ID = re.compile(r"^[A-Z0-9]{20}$")

NOT_CONFIGURED = (
    "this Treadle server has no TREADLE_SECRETS_KEY, under which access key secrets are "
    f"encrypted, so it can neither mint access key pairs nor check SigV4 signatures; the operator "
    f"sets TREADLE_SECRETS_KEY for the API ({SECRETS_KEY_HOWTO}) and restarts it "
    "(`treadle up` makes one by itself)"
)


class SecretsKeyError(StateConflictError):
    """TREADLE_SECRETS_KEY is not set, or no longer holds the key a secret was encrypted under:
    the operator's configuration must change (409)."""

    code = "secrets_key_unavailable"


class Keyring:
    """The operator's TREADLE_SECRETS_KEY as a MultiFernet: encrypts with the first key,
    decrypts with any. Built once per process from `PlatformConfig.secrets_key`."""

    def __init__(self, secrets_key: str) -> None:
        entries = [part.strip() for part in secrets_key.split(",") if part.strip()]
        self._box = (
            MultiFernet([Fernet(entry.encode("ascii")) for entry in entries]) if entries else None
        )

    def __repr__(self) -> str:
        return f"Keyring(configured={self.is_configured})"

    @property
    def is_configured(self) -> bool:
        return self._box is not None

    def encrypt(self, secret: str) -> str:
        return self._require().encrypt(secret.encode()).decode("ascii")

    def decrypt(self, ciphertext: str, access_key_id: str) -> str:
        try:
            return self._require().decrypt(ciphertext.encode("ascii")).decode()
        except (InvalidToken, UnicodeError):
            log.error(
                "the secret of access key %s cannot be decrypted with any key in "
                "TREADLE_SECRETS_KEY; put the key it was encrypted under back as a later "
                "comma-separated entry",
                access_key_id,
            )
            raise SecretsKeyError(
                f"the secret of access key {access_key_id} cannot be decrypted with this "
                "server's TREADLE_SECRETS_KEY (the key it was encrypted under was removed): the "
                "operator puts that key back as a later comma-separated entry, or you ask your "
                "tenant's admin for a new pair (treadle keys create --aws)"
            ) from None

    def _require(self) -> MultiFernet:
        if self._box is None:
            raise SecretsKeyError(NOT_CONFIGURED)
        return self._box


@dataclass(frozen=True)
class NewAccessKey:
    """A key just minted with its access key pair. `plaintext` (the `tml-` key) and
    `secret_access_key` are shown to the caller once and exist nowhere else in clear."""

    key: keys.ApiKey
    plaintext: str = field(repr=False)
    access_key_id: str
    secret_access_key: str = field(repr=False)


class SigningKey(NamedTuple):
    """Who an access key id stands for and its secret: `principal, secret = signing_key(...)`."""

    principal: Principal
    secret: str

    @property
    def key_id(self) -> str:
        return self.principal.key_id

    @property
    def tenant_id(self) -> str:
        return self.principal.tenant_id

    def __repr__(self) -> str:  # never the secret
        return f"SigningKey(principal={self.principal!r})"  # str() prints this too


def create_access_key(
    conn: sa.Connection,
    principal: Principal,
    keyring: Keyring,
    tenant_id: str | None = None,
    role: str = Role.MEMBER,
    name: str | None = None,
) -> NewAccessKey:
    """Mint an API key with an access key pair for a tenant (the caller's by default): the same
    checks as `keys.create_key` (an admin for its own tenant, the operator for any; a disabled
    tenant refused), and a 409 when TREADLE_SECRETS_KEY is not set."""
    require_tenant_admin(principal, tenant_id or principal.tenant_id, "creating a key")
    if not keyring.is_configured:
        raise SecretsKeyError(NOT_CONFIGURED)
    new = keys.create_key(conn, principal, tenant_id, role, name)
    access_key_id = ACCESS_KEY_PREFIX + "".join(
        secrets.choice(_ID_ALPHABET) for _ in range(ACCESS_KEY_ID_LENGTH - len(ACCESS_KEY_PREFIX))
    )  # 36^16 ids: a clash with the unique index would fail the mint, never mix two keys
    secret = "".join(secrets.choice(_SECRET_ALPHABET) for _ in range(SECRET_LENGTH))
    row = conn.execute(
        sa.update(api_keys)
        .where(api_keys.c.id == new.key.id)
        .values(access_key_id=access_key_id, secret_ciphertext=keyring.encrypt(secret))
        .returning(*api_keys.c)
    ).one()
    log.info("key %s got access key id %s", new.key.id, access_key_id)
    return NewAccessKey(keys.api_key_from_row(row), new.plaintext, access_key_id, secret)


def signing_key(conn: sa.Connection, keyring: Keyring, access_key_id: str) -> SigningKey:
    """The principal an access key id stands for and its decrypted secret: 401 for an unknown
    or revoked id, 403 when its tenant is disabled, 409 (SecretsKeyError) when the secret cannot
    be decrypted. Refreshes `last_used_at` like `keys.authenticate` (the caller commits)."""
    if not keyring.is_configured:
        raise SecretsKeyError(NOT_CONFIGURED)
    well_formed = ACCESS_KEY_ID.match(access_key_id) is not None
    row = _find(conn, access_key_id) if well_formed else None
    if row is None:
        # Only a well-formed id is echoed: a secret pasted as the id must reach no log.
        which = repr(access_key_id) if well_formed else "(not 20 uppercase letters and digits)"
        raise AuthenticationError(
            f"unknown access key id {which}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "to a pair this Treadle minted (treadle keys create --aws); ask your tenant's "
            "admin for one"
        )
    if row.revoked_at is not None:
        raise AuthenticationError(
            f"access key {access_key_id} (API key {row.id}) was revoked; ask your tenant's "
            "admin for a new pair (treadle keys create --aws)"
        )
    if row.disabled_at is not None:
        raise PermissionDeniedError(
            f"tenant {row.tenant_id} is disabled: its keys are refused until the operator "
            "enables it again"
        )
    secret = keyring.decrypt(row.secret_ciphertext, access_key_id)
    keys.mark_used(conn, row)
    return SigningKey(Principal(key_id=row.id, tenant_id=row.tenant_id, role=row.role), secret)


def _find(conn: sa.Connection, access_key_id: str) -> Any:
    return conn.execute(
        sa.select(
            api_keys.c.id,
            api_keys.c.tenant_id,
            api_keys.c.role,
            api_keys.c.secret_ciphertext,
            api_keys.c.revoked_at,
            api_keys.c.last_used_at,
            tenants.c.disabled_at,
            sa.func.now().label("now"),
        )
        .join(tenants, tenants.c.id == api_keys.c.tenant_id)
        .where(api_keys.c.access_key_id == access_key_id)
    ).first()
