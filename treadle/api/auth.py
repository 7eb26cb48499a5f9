"""Authentication of every request: the X-API-Key header -> the calling `Principal`, and an
access key id (SigV4, api/sagemaker/sigv4.py) -> its principal and secret.

A successful check is cached per API process for at most CACHE_SECONDS, keyed by the key's
SHA-256 (never its text), or by the access key id, so a busy key costs a dictionary lookup
instead of a query. Another API process therefore refuses a revoked key or a disabled tenant
within CACHE_SECONDS; the process that revoked or disabled evicts its own entries (both kinds) at
once, so it refuses the very next request. Failures are never cached: a key minted a moment ago
works at once everywhere. Also seeds the operator key (TREADLE_ADMIN_KEY) when the app starts,
and holds the process's keyring (TREADLE_SECRETS_KEY) that encrypts and decrypts access key
secrets. Imports platform only; never torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import sqlalchemy as sa
from flask import Flask, current_app

from treadle.platform.tenancy import access_keys, keys
from treadle.platform.tenancy.access_keys import Keyring, SigningKey
from treadle.platform.tenancy.tenants import DEFAULT_TENANT, Principal, Role

CACHE_SECONDS = 1.0
MAX_ENTRIES = 10_000
EXTENSION = "treadle.auth"


class _Owned(Protocol):
    """What a cached value says of its key: which key, and whose."""

    @property
    def key_id(self) -> str: ...

    @property
    def tenant_id(self) -> str: ...


V = TypeVar("V", bound=_Owned)


class PrincipalCache(Generic[V]):
    """Values of a key (its `Principal`, or its `SigningKey`) by a lookup string (the key's
    hash, or its access key id), each kept `ttl` seconds. Thread-safe.

    `forget` bumps a generation number, so a check that started before an eviction cannot put
    back what the eviction removed (it would otherwise outlive a revocation made meanwhile).
    """

    def __init__(
        self,
        ttl: float = CACHE_SECONDS,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.clock = clock
        self._entries: dict[str, tuple[V, float]] = {}
        self._lock = threading.Lock()
        self.generation = 0

    def get(self, digest: str) -> V | None:
        entry = self._entries.get(digest)
        if entry is None or entry[1] <= self.clock():
            return None
        return entry[0]

    def put(self, digest: str, value: V, generation: int) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            if generation != self.generation:
                return
            now = self.clock()
            if len(self._entries) >= self.max_entries:
                self._entries = {d: e for d, e in self._entries.items() if e[1] > now}
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
            self._entries[digest] = (value, now + self.ttl)

    def forget(self, *, key_id: str | None = None, tenant_id: str | None = None) -> None:
        """Drop the entries of a key, or of every key of a tenant."""
        with self._lock:
            self.generation += 1
            self._entries = {
                d: (p, expires)
                for d, (p, expires) in self._entries.items()
                if p.key_id != key_id and p.tenant_id != tenant_id
            }


@dataclass
class Authenticator:
    """Checks keys and access key ids against the database through `PrincipalCache`s."""

    db: sa.Engine
    cache: PrincipalCache[Principal]  # by the key's hash
    keyring: Keyring  # TREADLE_SECRETS_KEY
    signing_keys: PrincipalCache[SigningKey]  # by access key id

    def authenticate(self, plaintext: str | None) -> Principal:
        """The caller's principal; AuthenticationError (401) or PermissionDeniedError (403)."""
        if plaintext:
            cached = self.cache.get(keys.hash_key(plaintext))
            if cached is not None:
                return cached
        generation = self.cache.generation
        with self.db.begin() as conn:
            principal = keys.authenticate(conn, plaintext)
        assert plaintext  # keys.authenticate refused an empty key
        self.cache.put(keys.hash_key(plaintext), principal, generation)
        return principal

    def signing_key(self, access_key_id: str) -> SigningKey:
        """The principal an access key id stands for and its secret (`principal, secret =`):
        AuthenticationError (unknown or revoked), PermissionDeniedError (disabled tenant),
        access_keys.SecretsKeyError (no TREADLE_SECRETS_KEY, or not the one it needs)."""
        cached = self.signing_keys.get(access_key_id)
        if cached is not None:
            return cached
        generation = self.signing_keys.generation
        with self.db.begin() as conn:
            found = access_keys.signing_key(conn, self.keyring, access_key_id)
        self.signing_keys.put(access_key_id, found, generation)
        return found

    def forget(self, *, key_id: str | None = None, tenant_id: str | None = None) -> None:
        """Drop the cached checks (by key and by access key id) of a key, or of a tenant's."""
        self.cache.forget(key_id=key_id, tenant_id=tenant_id)
        self.signing_keys.forget(key_id=key_id, tenant_id=tenant_id)


def install(
    app: Flask,
    db: sa.Engine,
    admin_key: str,
    ttl: float = CACHE_SECONDS,
    *,
    secrets_key: str | None = None,
) -> None:
    """Seed `admin_key` (TREADLE_ADMIN_KEY, if set) as the operator's key of tenant `default`,
    upgrading its row if it exists, and give `app` its authenticator, whose keyring holds
    `secrets_key` (TREADLE_SECRETS_KEY; None: the one in the app's services' config)."""
    if admin_key:
        with db.begin() as conn:
            keys.seed_key(conn, DEFAULT_TENANT, admin_key, Role.OPERATOR)
    if secrets_key is None:
        services = app.extensions.get("treadle")
        secrets_key = services.config.secrets_key if services is not None else ""
    app.extensions[EXTENSION] = Authenticator(
        db, PrincipalCache(ttl), Keyring(secrets_key), PrincipalCache(ttl)
    )


def authenticator() -> Authenticator:
    return current_app.extensions[EXTENSION]  # type: ignore[no-any-return]


def authenticate(plaintext: str | None) -> Principal:
    """Authenticate the current request's key (the app's before_request hook calls this)."""
    return authenticator().authenticate(plaintext)


def signing_key(access_key_id: str) -> SigningKey:
    """The current app's lookup of an access key id (what SigV4 verification calls)."""
    return authenticator().signing_key(access_key_id)


def forget_key(key_id: str) -> None:
    """Evict a revoked key in this process at once (other processes within CACHE_SECONDS)."""
    authenticator().forget(key_id=key_id)


def forget_tenant(tenant_id: str) -> None:
    """Evict every key of a disabled tenant in this process at once."""
    authenticator().forget(tenant_id=tenant_id)
