"""The usage ledger of a scripted run on the real platform (HTTP, PostgreSQL, Redis, Celery
workers): every operation type is metered with the tokens counted here from the request sent and
the result received, and the run's bill equals the sum computed by hand."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from tinker import types

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


@dataclass(frozen=True)
class Metered:
    """One operation of the script and the tokens it must be billed for."""

    request_id: str
    op_type: str
    session_id: str
    tokens: dict[str, int]


@dataclass(frozen=True)
class Script:
    account: Account
    model_id: str
    ops: dict[str, Metered]


def sampled(result: types.SampleResponse) -> int:
    """Generated tokens, counted from the result: every sequence's tokens."""
    return sum(len(s.tokens) for s in result.sequences)


@pytest.fixture(scope="module")
def script(operator: Operator) -> Script:
    """One run through every operation type, each recorded with its hand-counted tokens."""
    operator.set_prices(PRICES)
    account = operator.new_account("scripted-run")
    client = account.client
    ops: dict[str, Metered] = {}

    def record(name: str, answer, op_type: str, session_id: str, **tokens: int) -> None:
        ops[name] = Metered(answer.json()["request_id"], op_type, session_id, tokens)

    session_id = client.new_session()
    created = client.open_model(session_id)
    model = created.json()["model_id"]
    client.done(created)
    record("create_model", created, "create_model", model)

    forward_data = [datum(6), datum(9, first=11)]
    answer = client.forward(model, 1, forward_data)
    client.done(answer)
    record("forward", answer, "forward_backward", model, prefill=input_tokens(forward_data))

    train_data = [datum(7), datum(4, first=3), datum(11, first=29)]
    answer = client.forward_backward(model, 2, train_data)
    client.done(answer)
    record("forward_backward", answer, "forward_backward", model, train=input_tokens(train_data))

    answer = client.optim_step(model, 3, lr=1e-2)
    client.done(answer)
    record("optim_step", answer, "optim_step", model)

    answer = client.post(
        "save_weights_for_sampler", {"model_id": model, "seq_id": 4, "sampling_session_seq_id": 0}
    )
    sampler = client.done(answer)["sampling_session_id"]
    record("save_weights_for_sampler", answer, "save_weights_for_sampler", model)

    prompt = [17, 4, 250, 9, 33]
    answer = client.sample(sampler, 0, prompt, num_samples=3, max_tokens=6, temperature=0.0)
    greedy = client.done(answer)
    record("sample", answer, "sample", model, prefill=len(prompt), sample=sampled(greedy))

    # Stops at the greedy continuation's second token: fewer tokens than max_tokens reserved.
    stop_at = greedy.sequences[0].tokens[1]
    answer = client.sample(sampler, 1, prompt, max_tokens=6, temperature=0.0, stop=[stop_at])
    stopped = client.done(answer)
    assert sampled(stopped) < 6, "the stop token ends the sample early"
    record("sample_stopped_early", answer, "sample", model, prefill=len(prompt),
           sample=sampled(stopped))  # fmt: skip

    scored = [8, 3, 91, 14, 2, 77, 5, 60]  # compute_logprobs, as the tinker SDK sends it
    answer = client.sample(sampler, 2, scored, prompt_logprobs=True, max_tokens=1)
    logprobs = client.done(answer)
    record("compute_logprobs", answer, "sample", model, prefill=len(scored),
           sample=sampled(logprobs))  # fmt: skip

    answer = client.post("save_weights", {"model_id": model, "seq_id": 5, "path": "scripted"})
    path = client.done(answer)["path"]
    record("save_weights", answer, "save_weights", model)

    answer = client.post(
        "load_weights", {"model_id": model, "seq_id": 6, "path": path, "optimizer": True}
    )
    client.done(answer)
    record("load_weights", answer, "load_weights", model)

    answer = client.post(
        "load_weights", {"session_id": session_id, "model_seq_id": 1, "path": path}
    )  # a new model created from the checkpoint: its first operation
    client.done(answer)
    record("load_weights_new_model", answer, "load_weights", answer.json()["model_id"])

    base = client.post(
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 1, "base_model": "treadle/tiny-debug"},
    ).json()["sampling_session_id"]  # fmt: skip
    answer = client.sample(base, 0, prompt[:3], num_samples=2, max_tokens=4, seed=5)
    out = client.done(answer)
    record("sample_base_model", answer, "sample", base, prefill=3, sample=sampled(out))
    return Script(account, model, ops)


OPERATIONS = [
    "create_model",
    "forward",
    "forward_backward",
    "optim_step",
    "save_weights_for_sampler",
    "sample",
    "sample_stopped_early",
    "compute_logprobs",
    "save_weights",
    "load_weights",
    "load_weights_new_model",
    "sample_base_model",
]


@pytest.mark.parametrize("name", OPERATIONS)
def test_an_operation_is_metered_with_the_tokens_of_its_request_and_result(
    script: Script, operator: Operator, name: str
) -> None:
    op = script.ops[name]
    row = operator.usage(script.account.tenant_id)[op.request_id]
    assert {c: getattr(row, f"{c}_tokens") for c in CLASSES} == {
        c: op.tokens.get(c, 0) for c in CLASSES
    }
    assert (row.op_type, row.session_id) == (op.op_type, op.session_id)


def test_the_ledger_has_one_row_per_operation_of_the_run(script: Script, operator: Operator):
    ledger = operator.usage(script.account.tenant_id)
    assert sorted(ledger) == sorted(op.request_id for op in script.ops.values())


def test_each_row_costs_its_tokens_at_the_price_in_effect_rounded_half_up(
    script: Script, operator: Operator
) -> None:
    ledger = operator.usage(script.account.tenant_id)
    for name, op in script.ops.items():
        row = ledger[op.request_id]
        for c in CLASSES:
            assert getattr(row, f"{c}_price") == micro_per_million(PRICES[c]), (name, c)
            assert getattr(row, f"{c}_micro_usd") == hand_cost(op.tokens.get(c, 0), PRICES[c])
        assert row.cost_micro_usd == hand_bill(op.tokens, PRICES), name
        assert row.unpriced is False


def test_the_bill_of_the_run_equals_the_sum_computed_by_hand(script: Script, operator: Operator):
    tenant = script.account.tenant_id
    by_hand = sum(hand_bill(op.tokens, PRICES) for op in script.ops.values())
    tokens = sum(sum(op.tokens.values()) for op in script.ops.values())
    assert by_hand > 0
    assert sum(r.cost_micro_usd for r in operator.usage(tenant).values()) == by_hand
    assert operator.month(tenant) == (by_hand, tokens, 0, 0)
    base_sampler = script.ops["sample_base_model"]
    assert operator.session_money(script.model_id) == (
        by_hand - hand_bill(base_sampler.tokens, PRICES),
        0,
    )
    assert operator.session_money(base_sampler.session_id) == (
        hand_bill(base_sampler.tokens, PRICES),
        0,
    )
    assert operator.reservations(tenant) == []


def test_the_monthly_bill_of_the_run_equals_the_sum_computed_by_hand(script: Script) -> None:
    """The tenant's bill (GET /api/v1/treadle/bill, this month): a line per token class at its
    one price, each the sum of the run's per-operation costs."""
    answer = script.account.client.http.get("/api/v1/treadle/bill")
    assert answer.status_code == 200, answer.text
    bill = answer.json()
    ops = script.ops.values()
    assert {
        line["token_class"]: (line["tokens"], line["amount_micro_usd"], line["unpriced"])
        for line in bill["lines"]
    } == {
        c: (
            sum(op.tokens.get(c, 0) for op in ops),
            sum(hand_cost(op.tokens.get(c, 0), PRICES[c]) for op in ops),
            False,
        )
        for c in CLASSES
    }
    assert len(bill["lines"]) == len(CLASSES)
    assert bill["total_micro_usd"] == sum(hand_bill(op.tokens, PRICES) for op in ops)
