"""Prices, quotas, usage and bills from the client side: what `treadle prices|quotas|usage|bill`
call, what `ServiceClient.get_usage` and `TrainingClient.get_usage` return.

Money comes back as `Decimal` USD (parsed from the server's decimal strings, never via float).
Anyone reads prices and their own tenant's quota, usage and bills; the operator's key
(TREADLE_ADMIN_KEY) sets prices and quotas and reads any tenant. Imports nothing from the
server side.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from treadle.client.rest import RestClient, segment

TOKEN_CLASSES = ("prefill", "sample", "train")


@dataclass(frozen=True)
class Usage:
    """Operations, tokens by class and their cost; `unpriced`: some tokens had no price and were
    billed at 0. `key` names the group (e.g. {"session_id": ..., "day": ...})."""

    operations: int
    tokens: dict[str, int]
    cost_usd: Decimal
    unpriced: bool
    key: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: dict[str, Any], key_names: Iterable[str] = ()) -> Usage:
        return cls(
            operations=int(body["operations"]),
            tokens={c: int(body[f"{c}_tokens"]) for c in TOKEN_CLASSES},
            cost_usd=Decimal(body["cost_usd"]),
            unpriced=bool(body["unpriced"]),
            key={name: body.get(name) for name in key_names},
        )

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())


@dataclass(frozen=True)
class UsageReport:
    """Usage in [since, until), grouped by `by`, and the total."""

    tenant_id: str
    since: datetime
    until: datetime
    by: tuple[str, ...]
    groups: list[Usage]
    total: Usage


@dataclass(frozen=True)
class SessionUsage:
    """A training session's usage so far, its spend cap and what it has spent and holds."""

    model_id: str
    usage: Usage
    cost_usd_by_class: dict[str, Decimal]
    max_cost_usd: Decimal | None
    spent_usd: Decimal
    reserved_usd: Decimal

    def __str__(self) -> str:
        tokens = ", ".join(f"{c} {n:,}" for c, n in self.usage.tokens.items())
        cap = "no cap" if self.max_cost_usd is None else f"cap ${self.max_cost_usd}"
        note = " (some tokens unpriced, billed at 0)" if self.usage.unpriced else ""
        return f"{self.model_id}: {tokens} tokens; ${self.usage.cost_usd} spent, {cap}{note}"


class BillingClient(RestClient):
    """Example:
    billing = BillingClient("http://127.0.0.1:8080", "tml-...")
    print(billing.get_bill("2026-11")["total_usd"])
    """

    def list_prices(self, base_model: str | None = None) -> list[dict[str, Any]]:
        """Every price version, each with `status`: superseded, in_effect or scheduled."""
        params = {"base_model": base_model} if base_model else {}
        return self._ok(self.http.get("/prices", params=params))["prices"]  # type: ignore[no-any-return]

    def set_prices(
        self,
        base_model: str,
        *,
        prefill: str | Decimal | None = None,
        sample: str | Decimal | None = None,
        train: str | Decimal | None = None,
        effective_from: datetime | date | None = None,
    ) -> list[dict[str, Any]]:
        """Set prices in USD per million tokens from `effective_from` (a date is its UTC
        midnight; now by default; never in the past). Operator only.

        Raises:
            TreadleApiError: 403 for a key that is not the operator's, 400 for a bad price or time.
        """
        body: dict[str, Any] = {"base_model": base_model}
        for name, value in (("prefill", prefill), ("sample", sample), ("train", train)):
            if value is not None:
                body[name] = str(value)
        if effective_from is not None:
            body["effective_from"] = effective_from.isoformat()
        return self._ok(self.http.post("/prices", json=body))["prices"]  # type: ignore[no-any-return]

    def get_quota(self, tenant_id: str) -> dict[str, Any]:
        """A tenant's limits and this month's spend (your own tenant; the operator any)."""
        return self._ok(self.http.get(f"/quotas/{segment(tenant_id)}"))  # type: ignore[no-any-return]

    def set_quota(self, tenant_id: str, **limits: Any) -> dict[str, Any]:
        """Change some of a tenant's limits (monthly_usd, monthly_tokens, max_sessions,
        requests_per_second, max_request_tokens; None removes one). Operator only; effective
        from the tenant's next request."""
        body = {k: str(v) if isinstance(v, Decimal) else v for k, v in limits.items()}
        return self._ok(self.http.patch(f"/quotas/{segment(tenant_id)}", json=body))  # type: ignore[no-any-return]

    def usage(
        self,
        *,
        month: str | None = None,
        since: datetime | str | None = None,
        until: datetime | str | None = None,
        by: Iterable[str] = (),
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """The raw usage answer: `{tenant_id, since, until, by, groups, total}`."""
        params: dict[str, str] = {}
        for name, value in (
            ("month", month),
            ("since", since),
            ("until", until),
            ("tenant", tenant),
        ):
            if value is not None:
                params[name] = value.isoformat() if isinstance(value, datetime) else value
        if by:
            params["by"] = ",".join(by)
        return self._ok(self.http.get("/usage", params=params))  # type: ignore[no-any-return]

    def get_usage(self, **kwargs: Any) -> UsageReport:
        """`usage(...)` as a UsageReport."""
        body = self.usage(**kwargs)
        names = [_KEY_NAMES.get(b, b) for b in body["by"]]
        return UsageReport(
            tenant_id=body["tenant_id"],
            since=datetime.fromisoformat(body["since"]),
            until=datetime.fromisoformat(body["until"]),
            by=tuple(body["by"]),
            groups=[Usage.from_json(g, names) for g in body["groups"]],
            total=Usage.from_json(body["total"]),
        )

    def get_bill(self, month: str | None = None, tenant: str | None = None) -> dict[str, Any]:
        """A month's invoice: `lines` (base_model, token_class, tokens, usd_per_million,
        amount_usd, unpriced) and `total_usd`; the current UTC month by default."""
        params = {k: v for k, v in (("month", month), ("tenant", tenant)) if v is not None}
        return self._ok(self.http.get("/bill", params=params))  # type: ignore[no-any-return]

    def session_usage(self, model_id: str) -> SessionUsage:
        body = self._ok(self.http.get(f"/sessions/{model_id}/usage"))
        cap = body["max_cost_usd"]
        return SessionUsage(
            model_id=body["model_id"],
            usage=Usage.from_json(body),
            cost_usd_by_class={c: Decimal(v) for c, v in body["cost_usd_by_class"].items()},
            max_cost_usd=None if cap is None else Decimal(cap),
            spent_usd=Decimal(body["spent_usd"]),
            reserved_usd=Decimal(body["reserved_usd"]),
        )


_KEY_NAMES = {"tenant": "tenant_id", "session": "session_id", "key": "key_id"}
