"""Prometheus counters of the money side: tokens and cost by token class, base model and tenant,
and quota rejections by reason. Counted after the transaction that records them commits (a
ledger row, a refusal), so a retried settlement is not counted twice. No session, request or key
ids in labels. The /metrics routes that expose them are the operations issue's.
Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

from prometheus_client import Counter

from treadle.platform.metering import Charge
from treadle.platform.prices import MICRO

TOKENS = Counter(
    "treadle_tokens",
    "Tokens processed by completed operations",
    ["token_class", "base_model", "tenant"],
)
COST = Counter(
    "treadle_cost_usd",
    "Cost of completed operations, at the prices in effect when they completed",
    ["token_class", "base_model", "tenant"],
)
REJECTIONS = Counter(
    "treadle_quota_rejections",
    "Requests refused by a quota, by the limit they met",
    ["reason"],
)


def count_charge(charge: Charge) -> None:
    """Count what a completed operation was billed."""
    for token_class, count in charge.tokens.items():
        if count:
            labels = (token_class, charge.base_model, charge.tenant_id)
            TOKENS.labels(*labels).inc(count)
            COST.labels(*labels).inc(charge.micro_usd.get(token_class, 0) / MICRO)


def count_rejection(reason: str) -> None:
    REJECTIONS.labels(reason).inc()
