"""The state of billing now: every price version with its status (superseded, in effect,
scheduled), and a tenant's quota beside what it has settled and holds this UTC month.

Role checks go through `usage.tenant_scope` (a tenant reads its own; the operator any).
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from treadle.platform.billing import prices, quotas
from treadle.platform.billing.usage import tenant_scope
from treadle.platform.eventlog.schema import tenant_months
from treadle.platform.tenancy.tenants import Principal


@dataclass(frozen=True)
class MonthSpend:
    """What a tenant has settled and holds (admitted, unsettled operations) this UTC month."""

    settled_micro_usd: int = 0
    settled_tokens: int = 0
    reserved_micro_usd: int = 0
    reserved_tokens: int = 0


def quota_status(
    conn: sa.Connection, principal: Principal, tenant: str | None
) -> tuple[str, quotas.Quota, MonthSpend]:
    """A tenant's quota and this month's spend (its own keys, or the operator)."""
    scope = tenant_scope(conn, principal, tenant)
    row = conn.execute(
        sa.select(tenant_months).where(
            tenant_months.c.tenant_id == scope,
            tenant_months.c.month
            == sa.cast(
                sa.func.date_trunc("month", sa.func.timezone("UTC", sa.func.now())), sa.Date
            ),
        )
    ).first()
    spend = MonthSpend()
    if row is not None:
        spend = MonthSpend(
            int(row.settled_micro_usd),
            int(row.settled_tokens),
            int(row.reserved_micro_usd),
            int(row.reserved_tokens),
        )
    return scope, quotas.get_quota(conn, scope), spend


def price_versions(
    conn: sa.Connection, base_model: str | None = None
) -> list[tuple[prices.Price, str]]:
    """Every price version (of one base model if given), each with its status now: "superseded",
    "in_effect" or "scheduled"."""
    now = conn.execute(sa.select(sa.func.now())).scalar_one()
    versions = prices.list_prices(conn, base_model)  # oldest first per model and class
    current: dict[tuple[str, str], int] = {}
    for i, p in enumerate(versions):
        if p.effective_from <= now:
            current[(p.base_model, p.token_class)] = i
    out = []
    for i, p in enumerate(versions):
        at = current.get((p.base_model, p.token_class))
        status = "scheduled" if p.effective_from > now else "in_effect" if at == i else "superseded"
        out.append((p, status))
    return out
