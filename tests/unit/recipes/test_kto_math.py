"""The kto recipe's loss and gradients against the formula written out in plain Python (Ethayarajh
et al. 2024, eq. 7, as TRL's KTOTrainer computes it), and its generated feedback."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from treadle.recipes import dpo_data, kto_data
from treadle.recipes.common.chat import datum
from treadle.recipes.kto import (
    KtoConfig,
    PromptReply,
    kl_estimate,
    kto_loss,
    label_metrics,
    main,
    make_loss_fn,
    mismatched,
)

CONFIG = KtoConfig(beta=0.5, desirable_weight=1.3, undesirable_weight=0.7)


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _reference(
    policy: list[float], reference: list[float], desirable: list[bool], z: float, c: KtoConfig
) -> tuple[float, list[float]]:
    """The mean loss and its derivative in each example's policy logprob, by hand: with
    r = lp - ref, a desirable example costs l_D (1 - s(b (r - z))), whose derivative in r is
    -l_D b s (1 - s); an undesirable one l_U (1 - s(b (z - r))), derivative +l_U b s (1 - s)."""
    n = len(policy)
    losses, grads = [], []
    for lp, ref, good in zip(policy, reference, desirable, strict=True):
        r = lp - ref
        if good:
            s = _sigmoid(c.beta * (r - z))
            losses.append(c.desirable_weight * (1 - s))
            grads.append(-c.desirable_weight * c.beta * s * (1 - s) / n)
        else:
            s = _sigmoid(c.beta * (z - r))
            losses.append(c.undesirable_weight * (1 - s))
            grads.append(c.undesirable_weight * c.beta * s * (1 - s) / n)
    return sum(losses) / n, grads


POLICY = [-1.0, -4.0, -2.5, -0.2]
REFERENCE = [-2.0, -3.0, -2.0, -1.0]
DESIRABLE = [True, False, False, True]


def test_the_loss_and_its_gradients_equal_the_written_out_formula() -> None:
    policy_B = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    # Mismatched pairs: log-ratios 0.5, 1.5, -0.4 -> z_ref = 1.6 / 3
    kl_policy_B = torch.tensor([-3.0, -1.5, -6.4], dtype=torch.float64, requires_grad=True)
    kl_reference_B = torch.tensor([-3.5, -3.0, -6.0], dtype=torch.float64)
    z_ref = kl_estimate(kl_policy_B, kl_reference_B)
    assert float(z_ref) == pytest.approx(1.6 / 3, abs=1e-12)
    loss, logratio_B = kto_loss(
        policy_B, torch.tensor(REFERENCE, dtype=torch.float64), torch.tensor(DESIRABLE),
        z_ref, CONFIG,
    )  # fmt: skip
    loss.backward()
    expected_loss, expected_grads = _reference(POLICY, REFERENCE, DESIRABLE, 1.6 / 3, CONFIG)
    assert logratio_B.tolist() == pytest.approx([1.0, -1.0, -0.5, 0.8], abs=1e-12)
    assert float(loss.detach()) == pytest.approx(expected_loss, abs=1e-6)
    assert policy_B.grad is not None
    assert policy_B.grad.tolist() == pytest.approx(expected_grads, abs=1e-6)
    # z_ref is detached: no gradient reaches the mismatched pairs' logprobs.
    assert kl_policy_B.grad is None


def test_a_negative_kl_estimate_is_clamped_to_zero() -> None:
    z_ref = kl_estimate(torch.tensor([-5.0, -4.0]), torch.tensor([-4.0, -3.5]))
    assert float(z_ref) == 0.0
    loss, _ = kto_loss(
        torch.tensor(POLICY), torch.tensor(REFERENCE), torch.tensor(DESIRABLE), z_ref, CONFIG
    )
    assert float(loss) == pytest.approx(_reference(POLICY, REFERENCE, DESIRABLE, 0.0, CONFIG)[0])


def test_the_custom_loss_puts_the_formulas_gradient_on_reply_tokens_only() -> None:
    data = [
        datum([1, 2], [3, 4], weights=[1.0, 1.0]),  # targets [2, 3, 4]: reply logprob -1 + -2
        datum([1, 2], [5], weights=[1.0]),  # targets [2, 5]
        datum([7], [8, 9], weights=[1.0, 1.0]),  # targets [8, 9]
    ]
    logprobs = [
        torch.tensor([-9.0, -1.0, -2.0], requires_grad=True),
        torch.tensor([-9.0, -4.0], requires_grad=True),
        torch.tensor([-0.5, -0.25], requires_grad=True),
    ]
    policy, reference, desirable, z = (
        [-3.0, -4.0, -0.75],
        [-2.5, -3.0, -1.0],
        [True, False, True],
        0.2,
    )
    loss, found = make_loss_fn(reference, desirable, z, CONFIG)(data, logprobs)
    loss.backward()
    expected_loss, g = _reference(policy, reference, desirable, z, CONFIG)
    assert float(loss.detach()) == pytest.approx(expected_loss, abs=1e-6)
    assert found["kto_loss:mean"] == pytest.approx(expected_loss, abs=1e-6)
    grads = [lp.grad.tolist() for lp in logprobs if lp.grad is not None]
    assert grads == [
        pytest.approx([0.0, g[0], g[0]], abs=1e-6),
        pytest.approx([0.0, g[1]], abs=1e-6),
        pytest.approx([g[2], g[2]], abs=1e-6),
    ]


def test_at_the_reference_the_loss_is_half_the_mean_weight() -> None:
    data = [datum([1], [2], weights=[1.0]), datum([1], [3], weights=[1.0])]
    logprobs = [torch.tensor([-1.0]), torch.tensor([-2.0])]
    loss, found = make_loss_fn([-1.0, -2.0], [True, False], 0.0, CONFIG)(data, logprobs)
    assert float(loss) == pytest.approx((1.3 + 0.7) / 4)
    assert found["reward_margin:mean"] == 0.0 and found["accuracy:mean"] == 0.0


def test_the_reward_margin_is_beta_times_the_difference_of_the_labels_mean_log_ratios() -> None:
    logratio_B = torch.tensor([2.0, -1.0, 4.0, 1.0])
    found = label_metrics(logratio_B, torch.tensor([True, False, True, False]), beta=0.1)
    assert found["desirable_reward"] == pytest.approx(0.3)
    assert found["undesirable_reward"] == pytest.approx(0.0)
    assert found["reward_margin"] == pytest.approx(0.3)
    # examples on their label's side of zero: 2.0, -1.0 and 4.0, not the undesirable 1.0
    assert found["accuracy"] == 0.75


def test_a_batch_with_one_label_has_no_margin() -> None:
    found = label_metrics(torch.tensor([1.0, 2.0]), torch.tensor([True, True]), beta=0.1)
    assert "undesirable_reward" not in found and "reward_margin" not in found


def test_each_prompt_is_paired_with_the_previous_examples_reply() -> None:
    examples = [PromptReply([1], [10]), PromptReply([2], [20]), PromptReply([3], [30])]
    assert mismatched(examples) == [
        PromptReply([1], [30]), PromptReply([2], [10]), PromptReply([3], [20])
    ]  # fmt: skip


def test_the_split_is_disjoint_by_its_rule_and_the_labels_alternate() -> None:
    train, held_out = kto_data.split(40, 12, seed=0)
    assert len(train) == 40 and len(held_out) == 12
    assert all(kto_data.is_held_out(e.pair) for e in held_out)
    assert not any(kto_data.is_held_out(e.pair) for e in train)
    assert not {e.pair.messages[-1]["content"] for e in train} & {
        e.pair.messages[-1]["content"] for e in held_out
    }
    for examples in (train, held_out):
        assert [e.is_desirable for e in examples] == [i % 2 == 0 for i in range(len(examples))]
        for e in examples:
            assert dpo_data.is_correct(e.reply, e.pair) == e.is_desirable
    assert {e.kind for e in train if not e.is_desirable} == set(dpo_data.REJECTED_KINDS)


def test_a_split_does_not_change_with_the_others_size() -> None:
    train, held_out = kto_data.split(30, 4, seed=1)
    assert kto_data.split(30, 20, seed=1)[0] == train
    assert kto_data.split(200, 4, seed=1)[1] == held_out
    assert kto_data.split(30, 4, seed=2) != (train, held_out)


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("--beta", "0", "must be a finite number above 0, not 0"),
        ("--desirable-weight", "-1", "must be a finite number above 0, not -1"),
        ("--undesirable-weight", "inf", "must be a finite number above 0, not inf"),
        ("--batch-size", "1", "must be 2 or more, not 1"),
        ("--train-size", "1", "must be 2 or more, not 1"),
        ("--eval-size", "0", "must be 2 or more, not 0"),
    ],
)
def test_a_bad_flag_is_a_usage_error_before_the_run_folder_is_made(
    flag: str, value: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_dir = tmp_path / "run"
    argv = ["--base-url", "http://127.0.0.1:9", "--api-key", "tml-x", "--log-dir", str(log_dir)]
    with pytest.raises(SystemExit) as exited:
        main([*argv, flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: {reason}" in capsys.readouterr().err
    assert not log_dir.exists()
