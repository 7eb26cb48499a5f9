"""The distill recipe's own arithmetic on hand-sized examples: where the teacher's logprobs are
read from, what each datum carries, the loss they make (the platform's `importance_sampling`)
against a hand computation, and that its expected gradient is the reverse KL's gradient."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from treadle.engine.losses.functions import get_loss
from treadle.recipes.distill import (
    SYSTEM,
    Rollout,
    completion_logprobs,
    distill_datum,
    rollout_metrics,
)
from treadle.recipes.sft import examples

IMPORTANCE_SAMPLING = get_loss("importance_sampling")


def loss_inputs(rollout: Rollout, beta: float) -> dict[str, torch.Tensor]:
    inputs = distill_datum(rollout, beta).loss_fn_inputs
    return {k: torch.tensor(inputs[k].data, dtype=torch.float64) for k in inputs}


def test_the_teacher_logprobs_are_the_completion_positions_of_prompt_plus_completion() -> None:
    # compute_logprobs on prompt (3 tokens) + completion (2): the first entry has no prefix.
    assert completion_logprobs([None, -1.0, -2.0, -3.0, -4.0], 2) == [-3.0, -4.0]
    with pytest.raises(ValueError, match="last 5 of 5"):
        completion_logprobs([None, -1.0, -2.0, -3.0, -4.0], 5)
    with pytest.raises(ValueError):
        completion_logprobs([None, -1.0], 0)


def test_a_datum_carries_sampling_logprobs_and_scaled_advantages_on_the_reply_only() -> None:
    rollout = Rollout([5, 6, 7], [8, 9], student_logprobs=[-1.0, -2.0],
                      teacher_logprobs=[-0.5, -3.0])  # fmt: skip
    d = distill_datum(rollout, beta=2.0)
    assert d.model_input.to_ints() == [5, 6, 7, 8]
    x = d.loss_fn_inputs
    assert x["target_tokens"].data == [6, 7, 8, 9]
    assert x["logprobs"].data == [0.0, 0.0, -1.0, -2.0]
    # 2 * (teacher - student): +1 where the teacher likes the token more, -2 where less.
    assert x["advantages"].data == [0.0, 0.0, 1.0, -2.0]


def test_the_loss_and_its_gradient_match_a_hand_computation() -> None:
    rollout = Rollout([5, 6, 7], [8, 9], student_logprobs=[-1.0, -2.0],
                      teacher_logprobs=[-0.5, -3.0])  # fmt: skip
    x = loss_inputs(rollout, beta=1.0)  # advantages 0, 0, 0.5, -1
    lp = torch.tensor([-7.0, -8.0, -0.5, -2.5], dtype=torch.float64, requires_grad=True)
    loss = IMPORTANCE_SAMPLING.compute(lp, x, {}).sum()
    # -(ratio * A) per token, ratio = exp(lp - sampling lp): exp(0.5) * 0.5 and exp(-0.5) * -1.
    hand = -(math.exp(0.5) * 0.5) - (math.exp(-0.5) * -1.0)
    assert loss.item() == pytest.approx(hand, abs=1e-12)
    loss.backward()
    assert lp.grad is not None
    expected = [0.0, 0.0, -math.exp(0.5) * 0.5, math.exp(-0.5)]
    assert lp.grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_the_expected_gradient_is_the_gradient_of_the_reverse_kl() -> None:
    """A one-token 'model' over 3 tokens: the loss on each possible sample, weighted by how likely
    the student is to draw it, has the gradient of KL(student || teacher): descending it moves
    the student toward the teacher, and a flipped sign would move it away."""
    logits = torch.tensor([0.3, -1.2, 0.8], dtype=torch.float64, requires_grad=True)
    teacher_lp = torch.log(torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64))
    student_lp = torch.log_softmax(logits, dim=0)
    expected_loss = torch.zeros((), dtype=torch.float64)
    for token in range(3):
        rollout = Rollout([0], [token], [student_lp[token].item()], [teacher_lp[token].item()])
        lp = student_lp[token].reshape(1)
        loss = IMPORTANCE_SAMPLING.compute(lp, loss_inputs(rollout, beta=1.0), {}).sum()
        expected_loss = expected_loss + student_lp[token].exp().detach() * loss
    (grad,) = torch.autograd.grad(expected_loss, logits, retain_graph=True)
    kl = (student_lp.exp() * (student_lp - teacher_lp)).sum()
    (kl_grad,) = torch.autograd.grad(kl, logits)
    # The datum carries float32 logprobs: equal to float32 precision.
    assert grad.tolist() == pytest.approx(kl_grad.tolist(), abs=1e-6)
    assert kl_grad.abs().max() > 0.1  # the check is not 0 == 0


def test_reverse_kl_is_the_mean_over_tokens_not_over_replies() -> None:
    rollouts = [
        Rollout([1], [2], [-1.0], [-3.0]),  # gap 2
        Rollout([1], [2, 3, 4], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]),  # gaps 0
    ]
    got = rollout_metrics(rollouts)
    assert got["reverse_kl"] == pytest.approx(0.5)  # 2 / 4 tokens, not (2 + 0) / 2 replies
    assert got["teacher_logprob"] == pytest.approx(-1.5)
    assert got["reply_tokens"] == pytest.approx(2.0)


def test_the_prompt_shows_the_shape_of_the_answer_the_teacher_is_trained_on() -> None:
    """The student only learns from what it samples; the prompt shows the reply's shape so that
    it samples it at all. The shape shown must stay the teacher's: the same keys, in order."""
    example = examples(1, seed=0)[0]
    system, user = example.chat(SYSTEM)
    shown = re.search(r"\{.*\}", system["content"])
    assert shown is not None and user == {"role": "user", "content": example.sentence}
    assert re.findall(r'"(\w+)":', shown.group()) == list(json.loads(example.reply))
