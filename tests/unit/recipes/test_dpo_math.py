"""The dpo recipe's own math against hand computations on tiny tensors, and its generated pairs."""

from __future__ import annotations

import math

import pytest
import torch

from treadle.recipes import dpo_data
from treadle.recipes.common.chat import datum
from treadle.recipes.dpo import dpo_loss, make_loss_fn, pair_logprobs, reply_logprob


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_the_loss_is_the_mean_of_minus_log_sigmoid_of_beta_times_the_margin() -> None:
    # pair 0: (-1 - -2) - (-3 - -2) = 1 - (-1) = 2;  pair 1: (-2 - -2) - (-1 - -2) = 0 - 1 = -1
    loss, margin_B = dpo_loss(
        torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0]),
        torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0]), beta=0.5,
    )  # fmt: skip
    assert margin_B.tolist() == [2.0, -1.0]
    # -log sigmoid(x) = log(1 + e^-x): beta * margins are 1 and -0.5
    assert float(loss) == pytest.approx((_softplus(-1.0) + _softplus(0.5)) / 2, rel=1e-6)


def test_the_gradient_pushes_chosen_up_and_rejected_down_by_beta_sigmoid_of_minus_the_reward() -> (
    None
):
    chosen = torch.tensor([-1.0, -2.0], requires_grad=True)
    rejected = torch.tensor([-3.0, -1.0], requires_grad=True)
    beta = 0.5
    loss, _ = dpo_loss(
        chosen, rejected, torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0]), beta
    )
    loss.backward()
    sigmoid = [1 / (1 + math.exp(beta * m)) for m in (2.0, -1.0)]  # sigmoid(-beta * margin)
    assert chosen.grad is not None and rejected.grad is not None
    assert chosen.grad.tolist() == pytest.approx([-beta * s / 2 for s in sigmoid], rel=1e-6)
    assert rejected.grad.tolist() == pytest.approx([beta * s / 2 for s in sigmoid], rel=1e-6)


def test_a_reply_logprob_sums_the_reply_tokens_only() -> None:
    # prompt [1, 2, 3] + reply [4, 5]: targets [2, 3, 4, 5], weights [0, 0, 1, 1]
    d = datum([1, 2, 3], [4, 5], weights=[1.0, 1.0])
    logprobs_T = torch.tensor([-10.0, -20.0, -0.5, -0.25])
    assert float(reply_logprob(d, logprobs_T)) == pytest.approx(-0.75)


def test_the_custom_loss_at_the_reference_is_log_2_with_gradient_on_replies_only() -> None:
    beta = 0.2
    data = [
        datum([1, 2], [3, 4], weights=[1.0, 1.0]),  # pair 0 chosen: targets [2, 3, 4]
        datum([1, 2], [5], weights=[1.0]),  # pair 0 rejected: targets [2, 5]
        datum([7], [8, 9], weights=[1.0, 1.0]),  # pair 1 chosen: targets [8, 9]
        datum([7], [6], weights=[1.0]),  # pair 1 rejected: targets [6]
    ]
    logprobs = [
        torch.tensor([-9.0, -1.0, -2.0], requires_grad=True),
        torch.tensor([-9.0, -4.0], requires_grad=True),
        torch.tensor([-0.5, -0.5], requires_grad=True),
        torch.tensor([-3.0], requires_grad=True),
    ]
    # The reference gives the policy's own reply logprobs: every margin is 0.
    loss, metrics = make_loss_fn([(-3.0, -4.0), (-1.0, -3.0)], beta)(data, logprobs)
    assert float(loss.detach()) == pytest.approx(math.log(2), rel=1e-9)
    assert metrics == {"dpo_loss:mean": pytest.approx(math.log(2)), "accuracy:mean": 0.0,
                       "margin:mean": 0.0}  # fmt: skip
    loss.backward()
    g = beta * 0.5 / 2  # beta * sigmoid(0) / B
    grads = [lp.grad.tolist() for lp in logprobs if lp.grad is not None]
    assert grads == [
        pytest.approx([0.0, -g, -g]),
        pytest.approx([0.0, g]),
        pytest.approx([-g, -g]),
        pytest.approx([g]),
    ]


def test_the_custom_loss_counts_a_pair_as_won_when_its_margin_is_positive() -> None:
    data = [datum([1], [2], weights=[1.0]), datum([1], [3], weights=[1.0])] * 2
    logprobs = [torch.tensor([v]) for v in (-1.0, -2.0, -2.0, -1.0)]
    # pair 0's margin: (-1 - -1.5) - (-2 - -2) = 0.5; pair 1's: (-2 - -1.5) - (-1 - -2) = -1.5
    _, metrics = make_loss_fn([(-1.5, -2.0), (-1.5, -2.0)], beta=1.0)(data, logprobs)
    assert metrics["accuracy:mean"] == 0.5
    assert metrics["margin:mean"] == pytest.approx(-0.5)
    assert metrics["dpo_loss:mean"] == pytest.approx((_softplus(-0.5) + _softplus(1.5)) / 2)


def test_a_margin_within_float_noise_is_a_tie_not_a_win() -> None:
    data = [datum([1], [2], weights=[1.0]), datum([1], [3], weights=[1.0])] * 2
    logprobs = [torch.tensor([v]) for v in (-1.0, -2.0, -1.0, -2.0)]
    # margins: 1e-6 (the noise between a training forward pass and the sampler) and 0.01
    reference = [(-1.0 - 1e-6, -2.0), (-1.01, -2.0)]
    _, metrics = make_loss_fn(reference, beta=1.0)(data, logprobs)
    assert metrics["accuracy:mean"] == 0.5


def test_pairs_need_an_even_number_of_datums() -> None:
    d = datum([1], [2], weights=[1.0])
    with pytest.raises(ValueError, match="even number"):
        pair_logprobs([d, d, d], [torch.tensor([-1.0])] * 3)


def test_every_chosen_reply_is_correct_and_every_rejected_one_is_not() -> None:
    pairs = dpo_data.pairs(60, seed=3)
    assert all(dpo_data.is_correct(p.chosen, p) for p in pairs)
    assert not any(dpo_data.is_correct(p.rejected, p) for p in pairs)
    assert {p.kind for p in pairs[:3]} == set(dpo_data.REJECTED_KINDS)
    for p in pairs:
        assert p.chosen in p.context and p.chosen not in p.question


def test_the_pairs_depend_only_on_the_seed() -> None:
    assert dpo_data.pairs(20, seed=1) == dpo_data.pairs(20, seed=1)
    assert dpo_data.pairs(20, seed=1) != dpo_data.pairs(20, seed=2)


def test_a_reply_is_correct_only_when_it_is_the_bare_answer() -> None:
    pair = dpo_data.pairs(1, seed=0)[0]
    assert dpo_data.is_correct(f" {pair.chosen}.\n", pair)
    assert not dpo_data.is_correct(f"It is {pair.chosen}.", pair)
    assert not dpo_data.is_correct(f"{pair.chosen}0", pair)
