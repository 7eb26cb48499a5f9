"""Treadle's billing routes under /api/v1/treadle: prices (everyone reads, the operator sets),
quotas (a tenant reads its own, the operator sets any), usage grouped over a time range, the
monthly bill, and one session's usage and spend.

Views parse (`schemas_billing`), call `platform.usage` / `prices` / `quotas` (where the role
checks live) and serialise; money goes out as USD decimal strings beside integer micro-dollars.
Imports platform only; never torch.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from flask import Blueprint, jsonify, request

from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.treadle.schemas_billing import BillQuery, SetPrices, SetQuota, UsageQuery
from treadle.platform.billing import billing_status, prices, quotas, usage
from treadle.platform.errors import ValidationError

bp = Blueprint("billing", __name__, url_prefix="/api/v1/treadle")


@bp.get("/prices")
def list_prices() -> Any:
    base_model = request.args.get("base_model") or None
    with services().db.connect() as conn:
        versions = billing_status.price_versions(conn, base_model)
    return jsonify(prices=[_price(p, status) for p, status in versions])


@bp.post("/prices")
def set_prices() -> Any:
    body = parse(SetPrices, json_body())
    given = {c: getattr(body, c) for c in prices.TOKEN_CLASSES if getattr(body, c) is not None}
    if not given:
        raise ValidationError("give at least one of prefill, sample, train (USD per million)")
    with services().db.begin() as conn:  # all classes or none
        set_ = [
            prices.set_price(
                conn,
                principal(),
                base_model=body.base_model,
                token_class=c,
                usd_per_million=value,
                effective_from=body.effective_from,
            )
            for c, value in given.items()
        ]
    now = datetime.now(UTC)
    response = jsonify(
        prices=[_price(p, "scheduled" if p.effective_from > now else "in_effect") for p in set_]
    )
    response.status_code = 201
    return response


@bp.get("/quotas/<tenant_id>")
def get_quota(tenant_id: str) -> Any:
    with services().db.connect() as conn:
        scope, quota, spend = billing_status.quota_status(conn, principal(), tenant_id)
    return jsonify(_quota(scope, quota, spend))


@bp.patch("/quotas/<tenant_id>")
def set_quota(tenant_id: str) -> Any:
    body = parse(SetQuota, json_body())
    changes: dict[str, Any] = {
        name: getattr(body, name) for name in body.model_fields_set if name != "monthly_usd"
    }
    if "monthly_usd" in body.model_fields_set:
        changes["monthly_micro_usd"] = (
            None
            if body.monthly_usd is None
            else prices.usd_to_micro(body.monthly_usd, "monthly_usd")
        )
    with services().db.begin() as conn:
        current = quotas.get_quota(conn, tenant_id)
        quotas.set_quota(conn, principal(), tenant_id, dataclasses.replace(current, **changes))
        scope, quota, spend = billing_status.quota_status(conn, principal(), tenant_id)
    return jsonify(_quota(scope, quota, spend))


@bp.get("/usage")
def usage_report() -> Any:
    query = parse(UsageQuery, request.args.to_dict())
    since, until = _window(query.month, query.since, query.until)
    with services().db.connect() as conn:
        report = usage.usage_report(
            conn, principal(), tenant=query.tenant, since=since, until=until, by=query.by
        )
    return jsonify(
        tenant_id=report.tenant_id,
        since=_time(report.since),
        until=_time(report.until),
        by=list(report.by),
        groups=[{**key, **totals.to_json()} for key, totals in report.groups],
        total=report.total.to_json(),
    )


@bp.get("/bill")
def bill() -> Any:
    query = parse(BillQuery, request.args.to_dict())
    year, month = query.month or _this_month()
    with services().db.connect() as conn:
        found = usage.monthly_bill(conn, principal(), tenant=query.tenant, year=year, month=month)
    return jsonify(
        tenant_id=found.tenant_id,
        month=f"{found.year:04d}-{found.month:02d}",
        since=_time(found.since),
        until=_time(found.until),
        lines=[
            {
                "base_model": line.base_model,
                "token_class": line.token_class,
                "tokens": line.tokens,
                "usd_per_million": None
                if line.micro_usd_per_million is None
                else usage.usd_short(line.micro_usd_per_million),
                "amount_usd": usage.usd(line.amount_micro_usd),
                "amount_micro_usd": line.amount_micro_usd,
                "unpriced": line.micro_usd_per_million is None,
                "first_at": _time(line.first_at),
                "last_at": _time(line.last_at),
            }
            for line in found.lines
        ],
        total_usd=usage.usd(found.total_micro_usd),
        total_micro_usd=found.total_micro_usd,
        unpriced=found.unpriced,
    )


@bp.get("/sessions/<path:model_id>/usage")
def session_usage(model_id: str) -> Any:
    with services().db.connect() as conn:
        found = usage.session_usage(conn, principal(), model_id)
    cap = found.max_cost_micro_usd
    return jsonify(
        model_id=found.model_id,
        base_model=found.base_model,
        status=found.status,
        **found.totals.to_json(),
        cost_usd_by_class={c: usage.usd(m) for c, m in found.cost_micro_usd_by_class.items()},
        max_cost_usd=None if cap is None else usage.usd(cap),
        spent_usd=usage.usd(found.spent_micro_usd),
        reserved_usd=usage.usd(found.reserved_micro_usd),
        remaining_usd=None
        if cap is None
        else usage.usd(max(0, cap - found.spent_micro_usd - found.reserved_micro_usd)),
    )


def _window(
    month: tuple[int, int] | None, since: datetime | None, until: datetime | None
) -> tuple[datetime, datetime]:
    """`month`, or `since`/`until` (since: the current month's start; until: now)."""
    if month is not None:
        if since is not None or until is not None:
            raise ValidationError("give either month or since/until, not both")
        return usage.month_bounds(*month)
    now = datetime.now(UTC)
    return since or usage.month_bounds(now.year, now.month)[0], until or now


def _this_month() -> tuple[int, int]:
    now = datetime.now(UTC)
    return now.year, now.month


def _time(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _price(price: prices.Price, status: str) -> dict[str, Any]:
    return {
        "base_model": price.base_model,
        "token_class": price.token_class,
        "usd_per_million": usage.usd_short(price.micro_usd_per_million),
        "micro_usd_per_million": price.micro_usd_per_million,
        "effective_from": _time(price.effective_from),
        "status": status,
        "created_by": price.created_by,
    }


def _quota(tenant_id: str, quota: quotas.Quota, spend: billing_status.MonthSpend) -> dict[str, Any]:
    budget = quota.monthly_micro_usd
    return {
        "tenant_id": tenant_id,
        "monthly_usd": None if budget is None else usage.usd_short(budget),
        "monthly_tokens": quota.monthly_tokens,
        "max_sessions": quota.max_sessions,
        "requests_per_second": quota.requests_per_second,
        "max_request_tokens": quota.max_request_tokens,
        "this_month": {
            "settled_usd": usage.usd(spend.settled_micro_usd),
            "reserved_usd": usage.usd(spend.reserved_micro_usd),
            "settled_tokens": spend.settled_tokens,
            "reserved_tokens": spend.reserved_tokens,
        },
    }
