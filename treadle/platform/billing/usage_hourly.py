"""Hourly usage buckets and checkpoint storage, for the Tinker protocol's billing routes.

Tokens come from the same ledger as `usage` (train -> "training", prefill -> "sampling_prefill",
sample -> "sampling_sample"), one bucket per UTC hour x class x base model x client session x key
x unit price, with the ledger's amount as its cost (None when unpriced). Storage is metered in
gigabyte-hours (GB = 10^9 bytes): a registry checkpoint counts from its creation until it is
deleted or expires; the platform's own recovery checkpoints (`auto_checkpoints`) count the same
way but as free storage, since no user chose to keep them. Storage has no price (prices are per
token class), so its cost is None. A caller sees its own tenant only.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from treadle.platform.errors import ValidationError
from treadle.platform.eventlog.schema import api_keys, client_sessions, sessions, usage
from treadle.platform.tenancy.tenants import Principal

HOUR = timedelta(hours=1)
MAX_WINDOW = timedelta(days=14)
BYTES_PER_GB = 10**9
KINDS = {"train": "training", "prefill": "sampling_prefill", "sample": "sampling_sample"}


@dataclass(frozen=True)
class Bucket:
    """One hourly usage event. `quantity` is tokens (token kinds), gigabyte-hours ("storage")
    or a count ("checkpoint")."""

    bucket_start: datetime
    kind: str
    quantity: int | float
    base_model: str | None
    session_id: str | None  # the client session (`create_session`)
    user_id: str | None  # the key
    user_name: str | None
    free: bool = False
    cost_micro_usd: int | None = None
    micro_usd_per_million: int | None = None


def check_window(starting_on: datetime, ending_before: datetime, now: datetime) -> None:
    """The Tinker rules: UTC hour boundaries, start not in the future, at most 14 days."""
    for name, value in (("starting_on", starting_on), ("ending_before", ending_before)):
        if value.tzinfo is None:
            raise ValidationError(f"{name} needs a time zone (e.g. 2026-07-13T00:00:00Z)")
        if value.astimezone(UTC) != _hour(value):
            raise ValidationError(
                f"{name} {value.isoformat()} is not on a UTC hour boundary; use e.g. "
                f"{_hour(value).isoformat().replace('+00:00', 'Z')}"
            )
    if ending_before <= starting_on:
        raise ValidationError("ending_before must be after starting_on")
    if ending_before - starting_on > MAX_WINDOW:
        raise ValidationError("the window is longer than 14 days; ask for 14 days at a time")
    if starting_on > now:
        raise ValidationError("starting_on is in the future; no usage is recorded there yet")


def _hour(value: datetime) -> datetime:
    return value.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def token_buckets(
    conn: sa.Connection, principal: Principal, starting_on: datetime, ending_before: datetime
) -> list[Bucket]:
    """Token usage of the caller's tenant in [starting_on, ending_before), by hour."""
    hour = sa.func.timezone(
        "UTC", sa.func.date_trunc("hour", sa.func.timezone("UTC", usage.c.completed_at))
    ).label("hour")
    found: list[Bucket] = []
    for token_class, kind in KINDS.items():
        tokens = usage.c[f"{token_class}_tokens"]
        price = usage.c[f"{token_class}_price"].label("price")
        dims = (
            hour,
            usage.c.base_model,
            sessions.c.client_session_id,
            usage.c.actor,
            api_keys.c.name,
            price,
        )
        rows = conn.execute(
            sa.select(
                *dims,
                sa.func.sum(tokens).label("tokens"),
                sa.func.sum(usage.c[f"{token_class}_micro_usd"]).label("amount"),
            )
            .select_from(
                usage.join(sessions, sessions.c.id == usage.c.session_id).outerjoin(
                    api_keys, api_keys.c.id == usage.c.actor
                )
            )
            .where(
                usage.c.tenant_id == principal.tenant_id,
                usage.c.completed_at >= starting_on,
                usage.c.completed_at < ending_before,
                tokens > 0,
            )
            .group_by(*dims)
        )
        found.extend(
            Bucket(
                bucket_start=r.hour,
                kind=kind,
                quantity=int(r.tokens),
                base_model=r.base_model,
                session_id=r.client_session_id,
                user_id=r.actor,
                user_name=r.name,
                cost_micro_usd=None if r.price is None else int(r.amount),
                micro_usd_per_million=r.price,
            )
            for r in rows
        )
    return found


# Live intervals of the tenant's checkpoints (registry ones end at deletion or expiry, recovery
# ones at deletion), cut into the window's hours; the owner is the key that created the session.
_STORAGE = sa.text("""
WITH live AS (
  SELECT session_id, size_bytes, created_at AS born, false AS free,
         LEAST(COALESCE(deleted_at, 'infinity'), COALESCE(expires_at, 'infinity'), now()) AS gone
  FROM checkpoints WHERE tenant_id = :tenant AND created_at < :until
  UNION ALL
  SELECT session_id, size_bytes, created_at, true, LEAST(COALESCE(deleted_at, 'infinity'), now())
  FROM auto_checkpoints WHERE tenant_id = :tenant AND created_at < :until
)
SELECT h AS hour, s.base_model, s.client_session_id, e.actor, k.name, l.free,
       sum(l.size_bytes * EXTRACT(EPOCH FROM LEAST(l.gone, h + interval '1 hour')
                                              - GREATEST(l.born, h))) AS byte_seconds
FROM generate_series(CAST(:since AS timestamptz), CAST(:until AS timestamptz) - interval '1 hour',
                     interval '1 hour') AS h
JOIN live l ON l.born < h + interval '1 hour' AND l.gone > h
JOIN sessions s ON s.id = l.session_id
LEFT JOIN events e ON e.session_id = l.session_id AND e.type = 'SessionCreated'
LEFT JOIN api_keys k ON k.id = e.actor
GROUP BY 1, 2, 3, 4, 5, 6
""")

_CHECKPOINTS_SAVED = sa.text("""
SELECT timezone('UTC', date_trunc('hour', timezone('UTC', c.created_at))) AS hour,
       s.base_model, s.client_session_id, e.actor, k.name, count(*) AS saved
FROM checkpoints c
JOIN sessions s ON s.id = c.session_id
LEFT JOIN events e ON e.session_id = c.session_id AND e.type = 'SessionCreated'
LEFT JOIN api_keys k ON k.id = e.actor
WHERE c.tenant_id = :tenant AND c.created_at >= :since AND c.created_at < :until
GROUP BY 1, 2, 3, 4, 5
""")


def storage_buckets(
    conn: sa.Connection, principal: Principal, starting_on: datetime, ending_before: datetime
) -> list[Bucket]:
    """Checkpoint storage (GB-hours) and checkpoints saved, by hour, of the caller's tenant."""
    params = {"tenant": principal.tenant_id, "since": starting_on, "until": ending_before}
    found = [
        Bucket(
            bucket_start=r.hour,
            kind="storage",
            quantity=round(float(r.byte_seconds) / 3600 / BYTES_PER_GB, 9),
            base_model=r.base_model,
            session_id=r.client_session_id,
            user_id=r.actor,
            user_name=r.name,
            free=r.free,
        )
        for r in conn.execute(_STORAGE, params)
        if r.byte_seconds > 0
    ]
    found.extend(
        Bucket(
            r.hour, "checkpoint", int(r.saved), r.base_model, r.client_session_id, r.actor, r.name
        )
        for r in conn.execute(_CHECKPOINTS_SAVED, params)
    )
    return found


def session_metadata(conn: sa.Connection, principal: Principal, ids: set[str]) -> dict[str, Any]:
    """Client session id -> its user_metadata (None when it has none), for the given ids."""
    if not ids:
        return {}
    rows = conn.execute(
        sa.select(client_sessions.c.id, client_sessions.c.user_metadata).where(
            client_sessions.c.tenant_id == principal.tenant_id,
            client_sessions.c.id.in_(sorted(ids)),
        )
    )
    return {r.id: (dict(r.user_metadata) or None) for r in rows}


@dataclass(frozen=True)
class StorageOwner:
    """The live registry checkpoints of the sessions one key created."""

    user_id: str | None
    user_name: str | None
    checkpoint_count: int
    size_bytes: int


_STORAGE_NOW = sa.text("""
SELECT e.actor, k.name, count(*) AS n, sum(c.size_bytes) AS size_bytes
FROM checkpoints c
LEFT JOIN events e ON e.session_id = c.session_id AND e.type = 'SessionCreated'
LEFT JOIN api_keys k ON k.id = e.actor
WHERE c.tenant_id = :tenant AND c.deleted_at IS NULL
  AND (c.expires_at IS NULL OR c.expires_at > now())
GROUP BY 1, 2 ORDER BY 4 DESC, 1
""")


def storage_now(conn: sa.Connection, principal: Principal) -> list[StorageOwner]:
    """The caller's tenant's live registry checkpoints now, by the key that created each
    session (recovery checkpoints are the platform's and free, so not listed)."""
    return [
        StorageOwner(r.actor, r.name, int(r.n), int(r.size_bytes))
        for r in conn.execute(_STORAGE_NOW, {"tenant": principal.tenant_id})
    ]
