"""The Tinker protocol's billing routes, served from Treadle's ledger so the official
`tinker billing usage` and `tinker billing checkpoint-storage` commands work against Treadle:

- `GET /api/v1/billing/usage/events?starting_on=&ending_before=`: hourly buckets (the shape of
  tinker.types.BillingUsageResponse) of tokens by class with their cost, checkpoint storage in
  gigabyte-hours, and checkpoints saved.
- `GET /api/v1/billing/usage/checkpoints/current`: live checkpoint storage now
  (tinker.types.CurrentCheckpointStorageUsageResponse).

A key sees its own tenant (the Tinker "organization"). The protocol carries money as floats; they
are made here, from integer micro-dollars, only for the wire. Imports platform only; never torch.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from flask import Blueprint, jsonify, request

from treadle.api.body import parse
from treadle.api.context import principal, services
from treadle.api.tinker.schemas_billing import BillingUsageQuery, StorageQuery
from treadle.platform.billing import usage_hourly
from treadle.platform.billing.prices import MICRO

bp = Blueprint("tinker_billing", __name__, url_prefix="/api/v1/billing")


@bp.get("/usage/events")
def usage_events() -> Any:
    query = parse(BillingUsageQuery, request.args.to_dict())
    start, end = query.starting_on.astimezone(UTC), query.ending_before.astimezone(UTC)
    with services().db.connect() as conn:
        usage_hourly.check_window(start, end, datetime.now(UTC))
        buckets = usage_hourly.token_buckets(conn, principal(), start, end)
        buckets += usage_hourly.storage_buckets(conn, principal(), start, end)
        ids = {b.session_id for b in buckets if b.session_id is not None}
        metadata = usage_hourly.session_metadata(conn, principal(), ids)
    buckets.sort(key=lambda b: (b.bucket_start, -b.quantity, b.kind, b.base_model or ""))
    return jsonify(
        data=[_event(b) for b in buckets],
        sessions={sid: {"user_metadata": _strings(meta)} for sid, meta in metadata.items()},
        # Every cost here is the ledger's own amount, final when recorded: "invoice-derived".
        cost_data_through=_time(min(end, datetime.now(UTC))),
    )


@bp.get("/usage/checkpoints/current")
def checkpoint_storage() -> Any:
    query = parse(StorageQuery, request.args.to_dict())
    owners = []
    if query.project_id is None:  # Treadle has no projects: none holds a checkpoint
        with services().db.connect() as conn:
            owners = usage_hourly.storage_now(conn, principal())
    return jsonify(
        effective_rate_usd_per_gigabyte_month=None,  # storage is metered, not priced
        data=[
            {
                "project_id": None,
                "org_user_urn": o.user_id,
                "user_email": None,
                "user_name": o.user_name,
                "checkpoint_count": o.checkpoint_count,
                "size_bytes": o.size_bytes,
                "size_gigabytes": o.size_bytes / usage_hourly.BYTES_PER_GB,
                "estimated_monthly_cost_usd": None,
            }
            for o in owners
        ],
    )


def _event(b: usage_hourly.Bucket) -> dict[str, Any]:
    info: dict[str, Any] = {"type": b.kind}
    if b.kind == "storage":
        info.update(free=b.free, gigabyte_hours=b.quantity)
    elif b.kind == "checkpoint":
        info["count"] = b.quantity
    elif b.kind == "sampling_prefill":
        info.update(cached=False, token_count=b.quantity)
    else:
        info["token_count"] = b.quantity
    return {
        "bucket_start": _time(b.bucket_start),
        "bucket_end": _time(b.bucket_start + usage_hourly.HOUR),
        "base_model": b.base_model,
        "user_id": b.user_id,
        "user_name": b.user_name,
        "session_id": b.session_id,
        "project_id": None,
        "estimated_cost_usd": _usd(b.cost_micro_usd),
        "effective_rate_usd_per_million_tokens": _usd(b.micro_usd_per_million),
        "effective_rate_usd_per_gigabyte_month": None,
        "event_info": info,
    }


def _usd(micro: int | None) -> float | None:
    return None if micro is None else float(Decimal(micro) / MICRO)


def _strings(metadata: dict[str, Any] | None) -> dict[str, str] | None:
    """The protocol's user_metadata is string-valued; other JSON values go as their JSON."""
    if metadata is None:
        return None
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}


def _time(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
