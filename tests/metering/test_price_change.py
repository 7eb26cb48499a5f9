"""A price change mid-month, on the real platform: a price scheduled a few seconds ahead (a price
is never set in the past) applies to usage completed after it takes effect, and the usage before
it stays billed at the old price, in the ledger and on the month's bill."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest

from tests.metering.conftest import (
    CLASSES,
    PRICES,
    Account,
    Operator,
    datum,
    hand_bill,
    hand_cost,
    input_tokens,
    micro_per_million,
)

pytestmark = pytest.mark.integration

NEW_PRICES = {"prefill": "4.5", "sample": "0.75", "train": "9.875"}


@dataclass(frozen=True)
class Change:
    account: Account
    switch: datetime
    # request id -> (its tokens counted by hand, the prices it must be billed at)
    billed: dict[str, tuple[dict[str, int], dict[str, str]]]


@pytest.fixture(scope="module")
def change(operator: Operator) -> Change:
    """Operations before a price change (one pair after it was scheduled, before it took
    effect) and after it."""
    operator.set_prices(PRICES)
    operator.assert_no_price_scheduled()
    account = operator.new_account("price-change")
    client = account.client
    model = client.create_model()
    sampler = client.sampler_for(model, 1)
    prompt = [12, 7, 3, 41, 5]
    billed: dict[str, tuple[dict[str, int], dict[str, str]]] = {}

    def train_and_sample(seq_id: int, length: int, prices: dict[str, str]) -> None:
        data = [datum(length, first=seq_id)]
        trained = client.forward_backward(model, seq_id, data)
        client.done(trained)
        billed[trained.json()["request_id"]] = ({"train": input_tokens(data)}, prices)
        sampled = client.sample(sampler, seq_id, prompt, num_samples=2, max_tokens=3, seed=seq_id)
        out = client.done(sampled)
        tokens = {"prefill": len(prompt), "sample": sum(len(s.tokens) for s in out.sequences)}
        billed[sampled.json()["request_id"]] = (tokens, prices)

    train_and_sample(2, 13, PRICES)
    switch = operator.db_now() + timedelta(seconds=5)
    operator.set_prices(NEW_PRICES, effective_from=switch)
    train_and_sample(3, 7, PRICES)  # scheduled, not yet in effect: still the old price
    assert operator.db_now() < switch, "the operations before the switch took over 5 s"
    deadline = time.monotonic() + 30
    while operator.db_now() < switch:
        assert time.monotonic() < deadline, "the database clock did not reach the switch"
        time.sleep(0.1)
    train_and_sample(4, 13, NEW_PRICES)
    return Change(account, switch, billed)


def test_a_price_change_mid_month_bills_earlier_usage_at_the_old_price(
    change: Change, operator: Operator
) -> None:
    ledger = operator.usage(change.account.tenant_id)
    for request_id, (tokens, prices) in change.billed.items():
        row = ledger[request_id]
        assert (row.completed_at < change.switch) == (prices is PRICES)
        assert {c: getattr(row, f"{c}_price") for c in CLASSES} == {
            c: micro_per_million(prices[c]) for c in CLASSES
        }
        assert row.cost_micro_usd == hand_bill(tokens, prices)
    settled = sum(hand_bill(tokens, prices) for tokens, prices in change.billed.values())
    assert operator.month(change.account.tenant_id)[0] == settled  # the rest cost 0 tokens


def test_the_bill_of_a_month_with_a_price_change_has_a_line_per_price(change: Change) -> None:
    answer = change.account.client.http.get("/api/v1/treadle/bill")
    assert answer.status_code == 200, answer.text
    bill = answer.json()
    expected: dict[tuple[str, int], list[int]] = {}
    for tokens, prices in change.billed.values():
        for c in CLASSES:
            line = expected.setdefault((c, micro_per_million(prices[c])), [0, 0])
            line[0] += tokens.get(c, 0)
            line[1] += hand_cost(tokens.get(c, 0), prices[c])
    assert {
        (line["token_class"], micro_per_million(line["usd_per_million"])): [
            line["tokens"],
            line["amount_micro_usd"],
        ]
        for line in bill["lines"]
    } == expected
    assert len(bill["lines"]) == 2 * len(CLASSES)
    assert bill["total_micro_usd"] == sum(amount for _, amount in expected.values())
