"""rl_math end to end on tiny-debug: per-step metrics, the curve, checkpoints, --resume, and the
same numbers through Treadle's SDK and the plain tinker SDK; and how a step's replies become
datums."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tinker

import treadle
from tests.conftest import Platform
from tests.recipes.conftest import RunRecipe, is_png, metrics_rows, saved_checkpoint, summary
from treadle.recipes import arithmetic
from treadle.recipes.common.connect import current_sampler, ready
from treadle.recipes.rl_math import grpo_step, rl_datums

TINY = ("--train-size", "16", "--questions", "2", "--group-size", "3", "--eval-size", "3",
        "--max-tokens", "5")  # fmt: skip
# Every number a step or an evaluation writes; elapsed_s and step_s are wall time.
COMPARED = ("reward", "answered", "loss", "reply_tokens", "sampled_logprob",
            "groups_with_signal", "eval_accuracy", "eval_sample")  # fmt: skip


def compared(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    return [{"step": r["step"], **{k: r[k] for k in COMPARED if k in r}} for r in rows]


def assert_same_run(got: list[dict[str, object]], want: list[dict[str, object]]) -> None:
    """Row by row, the same keys and values: texts, counts and rewards exactly; logprobs and
    losses to float32 rounding (the worker may batch the two runs' requests differently)."""
    assert len(got) == len(want)
    for ours, theirs in zip(compared(got), compared(want), strict=True):
        assert ours.keys() == theirs.keys(), ours["step"]
        for key, value in ours.items():
            expected = theirs[key]
            if isinstance(value, float) and isinstance(expected, float):
                assert value == pytest.approx(expected, rel=1e-5, abs=1e-6), (ours["step"], key)
            else:
                assert value == expected, (ours["step"], key)


def test_a_run_logs_every_step_evaluates_and_draws_its_curve(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    done = run_recipe("rl_math", *TINY, "--steps", "3", "--eval-every", "2", "--save-every", "2",
                      log_dir=tmp_path)  # fmt: skip
    rows = metrics_rows(tmp_path)
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 2, 3]
    for r in steps:
        assert 0.0 <= r["reward"] <= 1.0 and r["reply_tokens"] == 5  # tiny-debug never stops
        assert r["sampled_logprob"] < 0
    assert is_png(tmp_path / "curve.png")
    checkpoint = saved_checkpoint(tmp_path)
    assert checkpoint["step"] == 3 and checkpoint["state"].startswith("tinker://")
    result = summary(done)
    assert result["held_out_accuracy_before"] == rows[0]["eval_accuracy"]
    assert result["held_out_accuracy_after"] == rows[-1]["eval_accuracy"]


def test_resume_samples_what_the_uninterrupted_run_sampled(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_recipe("rl_math", *TINY, "--steps", "3", "--save-every", "2", "--eval-every", "0",
               log_dir=whole)  # fmt: skip
    run_recipe("rl_math", *TINY, "--steps", "2", "--save-every", "2", "--eval-every", "0",
               log_dir=parts)  # fmt: skip
    run_recipe("rl_math", *TINY, "--steps", "3", "--save-every", "2", "--eval-every", "0",
               "--resume", log_dir=parts)  # fmt: skip
    resumed, expected = metrics_rows(parts), metrics_rows(whole)
    # The first part's closing evaluation (at step 2) stays in the file; compare the steps and
    # the final evaluation.
    resumed = [r for r in resumed if "reward" in r] + resumed[-1:]
    expected = [r for r in expected if "reward" in r] + expected[-1:]
    assert [r["step"] for r in resumed] == [r["step"] for r in expected] == [1, 2, 3, 3]
    # Step 3 ran in a new session loaded from the step-2 checkpoint, on step 3's questions and
    # seeds: the same samples (hence logprobs) as the uninterrupted run.
    assert_same_run(resumed, expected)


def test_treadle_and_tinker_clients_write_the_same_metrics(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    args = (*TINY, "--steps", "2", "--eval-every", "1", "--save-every", "0", "--seed", "7")
    run_recipe("rl_math", *args, log_dir=tmp_path / "treadle", client="treadle")
    run_recipe("rl_math", *args, log_dir=tmp_path / "tinker", client="tinker")
    ours, theirs = metrics_rows(tmp_path / "treadle"), metrics_rows(tmp_path / "tinker")
    assert [r["step"] for r in ours] == [0, 1, 1, 2, 2]
    assert_same_run(ours, theirs)


def test_a_different_seed_samples_differently(run_recipe: RunRecipe, tmp_path: Path) -> None:
    """The equality above means something: the logged numbers do follow the seeds."""
    args = (*TINY, "--steps", "1", "--eval-every", "0", "--save-every", "0")
    run_recipe("rl_math", *args, "--seed", "1", log_dir=tmp_path / "a")
    run_recipe("rl_math", *args, "--seed", "2", log_dir=tmp_path / "b")
    a = [r for r in metrics_rows(tmp_path / "a") if "reward" in r]
    b = [r for r in metrics_rows(tmp_path / "b") if "reward" in r]
    assert a[0]["sampled_logprob"] != b[0]["sampled_logprob"]


def _seq(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(tokens=tokens, logprobs=[-1.0] * len(tokens))


def test_replies_whose_group_agreed_are_not_trained_on() -> None:
    prompt = [1, 2, 3]
    groups = [
        (prompt, [_seq([4, 5]), _seq([6, 7])], [0.0, 0.0]),  # both right or both wrong
        (prompt, [_seq([8]), _seq([9, 10, 11])], [0.5, -0.5]),
    ]
    datums = rl_datums(groups)
    assert [d.loss_fn_inputs["target_tokens"].data for d in datums] == [
        [2, 3, 8],
        [2, 3, 9, 10, 11],
    ]


def test_advantages_are_spread_over_the_batch_tokens_and_zero_on_the_prompt() -> None:
    prompt = [1, 2, 3]
    groups = [(prompt, [_seq([8]), _seq([9, 10, 11])], [0.5, -0.5])]
    first, second = (d.loss_fn_inputs["advantages"].data for d in rl_datums(groups))
    # 4 trained tokens in all: each token carries its reply's advantage / 4.
    assert first == [0.0, 0.0, 0.125]
    assert second == [0.0, 0.0, -0.125, -0.125, -0.125]


def test_steps_with_signal_train_alike_through_both_clients(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On tiny-debug no reply ever earns the verifier's reward, so the runs above compare no
    training. Here a stand-in reward (an even-length reply is "right") gives every step groups
    with a signal; two steps of `grpo_step` through Treadle's SDK and the plain tinker SDK train
    the same losses, and the second step's samples (from the weights the first step trained)
    are the same."""
    monkeypatch.setattr(arithmetic, "reward", lambda text, answer: float(len(text) % 2 == 0))
    args = SimpleNamespace(group_size=4, max_tokens=5, temperature=1.0, seed=3,
                           loss="importance_sampling", learning_rate=5e-2)  # fmt: skip
    batch = arithmetic.problems(2, seed=3, max_operand=10)
    treadle_svc = treadle.ServiceClient(base_url=platform.base_url, api_key=platform.admin_key)
    tinker_svc = tinker.ServiceClient(base_url=platform.base_url, api_key=platform.admin_key)
    results = []
    try:
        clients = [
            ready(svc.create_lora_training_client("treadle/tiny-debug", rank=4, seed=3))
            for svc in (treadle_svc, tinker_svc)
        ]
        tokenizer = clients[0].get_tokenizer()  # the plain SDK's would come from the hub
        for tc in clients:
            results.append([grpo_step(tc, tokenizer, batch, step, args) for step in (0, 1)])
        fresh = treadle_svc.create_lora_training_client("treadle/tiny-debug", rank=4, seed=3)
        probe = [probed(tc) for tc in (*clients, fresh)]
    finally:
        treadle_svc.close()
        tinker_svc.close("success").result()
    ours, theirs = results
    assert all(r.loss is not None and r.groups_with_signal > 0 for r in ours)
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.reward == other.reward and mine.groups_with_signal == other.groups_with_signal
        assert mine.loss == pytest.approx(other.loss, rel=1e-5, abs=1e-7)
        assert mine.sampled_logprob == pytest.approx(other.sampled_logprob, rel=1e-5)
    # The trained weights agree, and differ from an untrained adapter's: the same greedy reply
    # to one prompt, its logprobs equal to float32 rounding and unlike the fresh adapter's.
    (ours_tokens, ours_lp), (theirs_tokens, theirs_lp), (_, fresh_lp) = probe
    assert ours_tokens == theirs_tokens
    assert ours_lp == pytest.approx(theirs_lp, rel=1e-5, abs=1e-6)
    assert ours_lp != pytest.approx(fresh_lp, rel=1e-3, abs=1e-3)


def probed(tc: Any) -> tuple[list[int], list[float]]:
    """A greedy reply of 4 tokens to a fixed prompt from the client's current weights."""
    params = tinker.types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)
    prompt = tinker.types.ModelInput.from_ints([1, 9690, 198, 2683])
    seq = current_sampler(tc).sample(prompt, 1, params).result().sequences[0]
    return list(seq.tokens), list(seq.logprobs)
