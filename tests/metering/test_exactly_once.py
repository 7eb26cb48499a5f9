"""Exactly one usage record per operation when a request is resent and when its Celery wake-up
is delivered again, on the real platform (HTTP, PostgreSQL, Redis, Celery workers). The ledger's
key alone would refuse a second row, so each test also proves the money counters moved once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from tests.conftest import Platform
from tests.metering.conftest import (
    PRICES,
    Account,
    Operator,
    datum,
    hand_bill,
    input_tokens,
    wait_consumed,
)
from treadle.platform.sessions import routing

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def celery_app(platform: Platform) -> Iterator[Celery]:
    app = routing.make_celery(platform.redis_url)
    yield app
    app.close()


def test_a_resent_training_request_leaves_one_usage_record(
    operator: Operator, account: Account
) -> None:
    client = account.client
    model = client.create_model()
    data = [datum(9), datum(5, first=40)]
    first = client.forward_backward(model, 1, data)
    again = client.forward_backward(model, 1, data)  # resent while it may still be pending
    client.done(first)
    after = client.forward_backward(model, 1, data)  # resent after it completed
    assert first.json() == again.json() == after.json()
    assert [e["seq_id"] for e in operator.events(model, "OperationRequested")] == [0, 1]
    operator.assert_one_row_per_completed_operation(model)
    cost = hand_bill({"train": input_tokens(data)}, PRICES)
    assert operator.month(account.tenant_id) == (cost, input_tokens(data), 0, 0)
    assert operator.session_money(model) == (cost, 0)


def test_a_resent_sample_request_leaves_one_usage_record(
    operator: Operator, account: Account
) -> None:
    client = account.client
    model = client.create_model()
    sampler = client.sampler_for(model, 1)
    prompt = [3, 1, 4, 1, 5, 9]
    first = client.sample(sampler, 0, prompt, num_samples=2, max_tokens=5, seed=2)
    again = client.sample(sampler, 0, prompt, num_samples=2, max_tokens=5, seed=2)
    out = client.done(first)
    after = client.sample(sampler, 0, prompt, num_samples=2, max_tokens=5, seed=2)
    assert first.json() == again.json() == after.json()
    operator.assert_one_row_per_completed_operation(model)
    tokens = {"prefill": len(prompt), "sample": sum(len(s.tokens) for s in out.sequences)}
    assert operator.month(account.tenant_id) == (
        hand_bill(tokens, PRICES),
        sum(tokens.values()),
        0,
        0,
    )


def test_a_redelivered_wake_up_leaves_one_usage_record(
    operator: Operator, account: Account, platform: Platform, celery_app: Celery
) -> None:
    client = account.client
    model = client.create_model()
    data = [datum(8)]
    trained = client.forward_backward(model, 1, data)
    sampler = client.sampler_for(model, 2)
    prompt = [7, 7, 2]
    sampled = client.sample(sampler, 0, prompt, max_tokens=4, seed=3)
    for answer in (trained, sampled):
        routing.wake(celery_app, model, answer.json()["request_id"])  # while it may be pending
    out = client.done(sampled)
    client.done(trained)
    completed = [e["request_id"] for e in operator.events(model, "OperationCompleted")]
    assert len(completed) == 4  # create_model, forward_backward, the sampler's save, sample
    for request_id in completed:
        routing.wake(celery_app, model, request_id)  # delivered again after it completed
        routing.wake(celery_app, model, request_id)
    wait_consumed(platform.redis_url, model)
    operator.assert_one_row_per_completed_operation(model)
    per_op = [
        {"train": input_tokens(data)},
        {"prefill": len(prompt), "sample": len(out.sequences[0].tokens)},
    ]
    assert operator.month(account.tenant_id) == (
        sum(hand_bill(tokens, PRICES) for tokens in per_op),
        sum(sum(tokens.values()) for tokens in per_op),
        0,
        0,
    )
