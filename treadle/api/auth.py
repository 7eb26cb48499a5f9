"""Authentication of every request: the X-API-Key header -> the calling `Principal`.

A successful check is cached per API process for at most CACHE_SECONDS, keyed by the key's
SHA-256 (never its text), so a busy key costs a dictionary lookup instead of a query. Another
API process therefore refuses a revoked key or a disabled tenant within CACHE_SECONDS; the
process that revoked or disabled evicts its own entries at once, so it refuses the very next
request. Failures are never cached: a key minted a moment ago works at once everywhere.
Also seeds the operator key (TREADLE_ADMIN_KEY) when the app starts.
Imports platform only; never torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from flask import Flask, current_app

from treadle.platform.tenancy import keys
from treadle.platform.tenancy.tenants import DEFAULT_TENANT, Principal, Role

CACHE_SECONDS = 1.0
MAX_ENTRIES = 10_000
EXTENSION = "treadle.auth"


class PrincipalCache:
    """Principals by key hash, each kept `ttl` seconds. Thread-safe.

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
        self._entries: dict[str, tuple[Principal, float]] = {}
        self._lock = threading.Lock()
        self.generation = 0

    def get(self, digest: str) -> Principal | None:
        entry = self._entries.get(digest)
        if entry is None or entry[1] <= self.clock():
            return None
        return entry[0]

    def put(self, digest: str, principal: Principal, generation: int) -> None:
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
            self._entries[digest] = (principal, now + self.ttl)

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
    """Checks keys against the database through a `PrincipalCache`."""

    db: sa.Engine
    cache: PrincipalCache

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


def install(app: Flask, db: sa.Engine, admin_key: str, ttl: float = CACHE_SECONDS) -> None:
    """Seed `admin_key` (TREADLE_ADMIN_KEY, if set) as the operator's key of tenant `default`,
    upgrading its row if it exists, and give `app` its authenticator."""
    if admin_key:
        with db.begin() as conn:
            keys.seed_key(conn, DEFAULT_TENANT, admin_key, Role.OPERATOR)
    app.extensions[EXTENSION] = Authenticator(db, PrincipalCache(ttl))


def authenticator() -> Authenticator:
    return current_app.extensions[EXTENSION]  # type: ignore[no-any-return]


def authenticate(plaintext: str | None) -> Principal:
    """Authenticate the current request's key (the app's before_request hook calls this)."""
    return authenticator().authenticate(plaintext)


def forget_key(key_id: str) -> None:
    """Evict a revoked key in this process at once (other processes within CACHE_SECONDS)."""
    authenticator().cache.forget(key_id=key_id)


def forget_tenant(tenant_id: str) -> None:
    """Evict every key of a disabled tenant in this process at once."""
    authenticator().cache.forget(tenant_id=tenant_id)
