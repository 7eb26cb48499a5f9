"""Quotas per tenant: a monthly spend and token budget, concurrent live sessions, a request rate
and the largest single request. The operator sets them (API, CLI); they apply from the next
request. A missing row, or a missing limit in it, means no limit.

Budgets are enforced by reservation (`metering`); the session limit here, exactly under races
(the tenant's row is locked while live sessions are counted); the request rate by a token bucket
in Redis (`RateLimiter`), which lets requests through while Redis is down and says so in the
log. Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields
from decimal import Decimal
from typing import Any

import redis
import sqlalchemy as sa

from treadle.platform.billing.prices import MICRO
from treadle.platform.errors import NotFoundError, RateLimitedError, ValidationError
from treadle.platform.eventlog.schema import quotas, sessions, tenants
from treadle.platform.sessions.sessions import ADAPTER_KINDS, SessionStatus
from treadle.platform.tenancy.tenants import Principal, require_operator

log = logging.getLogger(__name__)

SESSION_RETRY_SECONDS = 30


@dataclass(frozen=True)
class Quota:
    """A tenant's limits; None is no limit."""

    monthly_micro_usd: int | None = None
    monthly_tokens: int | None = None
    max_sessions: int | None = None
    requests_per_second: float | None = None
    max_request_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "monthly_usd": None
            if self.monthly_micro_usd is None
            else str(Decimal(self.monthly_micro_usd) / MICRO),
            "monthly_tokens": self.monthly_tokens,
            "max_sessions": self.max_sessions,
            "requests_per_second": self.requests_per_second,
            "max_request_tokens": self.max_request_tokens,
        }


_GET_QUOTA = sa.select(quotas).where(quotas.c.tenant_id == sa.bindparam("tenant_id"))  # per request


def get_quota(conn: sa.Connection, tenant_id: str) -> Quota:
    row = conn.execute(_GET_QUOTA, {"tenant_id": tenant_id}).first()
    return Quota() if row is None else quota_from_row(row)


def quota_from_row(row: sa.Row[Any], *, prefix: str = "") -> Quota:
    """A quota from a row of the `quotas` table's columns (named `prefix` + column; all NULL:
    the tenant has none, no limit)."""
    return Quota(**{f.name: getattr(row, prefix + f.name) for f in fields(Quota)})


def set_quota(conn: sa.Connection, principal: Principal, tenant_id: str, quota: Quota) -> Quota:
    """Replace a tenant's quota (operator only); it applies from the next request."""
    require_operator(principal, "setting quotas")
    bounds = {"monthly_micro_usd": 2**62, "monthly_tokens": 2**62, "max_sessions": 2**31,
              "max_request_tokens": 2**62}  # fmt: skip
    for name, bound in bounds.items():
        value = getattr(quota, name)
        if value is not None and not 0 <= value < bound:
            raise ValidationError(
                f"{name} is {value}; give 0 to {bound - 1} (or leave it unset: no limit)"
            )
    rps = quota.requests_per_second
    if rps is not None and not (math.isfinite(rps) and 0 < rps <= 1e6):
        raise ValidationError(f"requests_per_second is {rps}; give a number in (0, 1e6]")
    if conn.execute(sa.select(tenants.c.id).where(tenants.c.id == tenant_id)).first() is None:
        raise NotFoundError(f"tenant {tenant_id} not found")
    values = {f.name: getattr(quota, f.name) for f in fields(Quota)}
    stmt = sa.dialects.postgresql.insert(quotas).values(
        tenant_id=tenant_id, updated_by=principal.key_id, **values
    )
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["tenant_id"],
            set_={**values, "updated_by": principal.key_id, "updated_at": sa.func.now()},
        )
    )
    return get_quota(conn, tenant_id)


def check_session_slot(conn: sa.Connection, tenant_id: str) -> None:
    """Refuse (429) a new training session when the tenant has `max_sessions` live ones. Locks
    the tenant's row until the caller's transaction ends, so racing creations count one by one."""
    conn.execute(sa.select(tenants.c.id).where(tenants.c.id == tenant_id).with_for_update())
    limit = get_quota(conn, tenant_id).max_sessions
    if limit is None:
        return
    live = conn.execute(
        sa.select(sa.func.count()).where(
            sessions.c.tenant_id == tenant_id,
            sessions.c.kind.in_(ADAPTER_KINDS),  # replays hold an adapter too
            sessions.c.status.in_((SessionStatus.CREATED, SessionStatus.RUNNING)),
        )
    ).scalar_one()
    if live >= limit:
        raise RateLimitedError(
            f"tenant {tenant_id} has {live} live training sessions (replays count), its limit; stop one (or let "
            "an idle one expire) before starting another",
            limit="max_sessions",
            value=limit,
            current=live,
            retry_after=SESSION_RETRY_SECONDS,
        )


# A token bucket per tenant: `rate` tokens a second, at most max(1, rate) stored. Atomic in
# Redis: returns 0 when the request may go, else the seconds until a token is there.
_BUCKET = """
local rate = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local capacity = math.max(1, rate)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or capacity
local at = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'at', now)
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / rate) + 60)
return tostring(wait)
"""


class RateLimiter:
    """Request rate per tenant, a token bucket in Redis. Fails open: while Redis cannot be
    reached every request goes through, and the log says so (once per outage)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._script = client.register_script(_BUCKET)
        self._warned = False

    def check(self, tenant_id: str, requests_per_second: float | None) -> None:
        """Take one token of the tenant's bucket, or raise RateLimitedError (429)."""
        if requests_per_second is None:
            return
        try:
            wait = float(
                self._script(
                    keys=[f"treadle:rate:{tenant_id}"], args=[requests_per_second, time.time()]
                )  # fmt: skip
            )
        except redis.RedisError as exc:
            if not self._warned:
                log.warning("rate limits are not enforced while Redis is unreachable: %s", exc)
                self._warned = True
            return
        self._warned = False
        if wait > 0:
            raise RateLimitedError(
                f"tenant {tenant_id} is over its limit of {requests_per_second:g} requests a "
                f"second; retry in {wait:.2f} s",
                limit="requests_per_second",
                value=requests_per_second,
                current=requests_per_second,
                retry_after=max(1, math.ceil(wait)),
            )
