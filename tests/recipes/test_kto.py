"""kto end to end on tiny-debug: per-step metrics, held-out evaluation, the curve, checkpoints and
--resume, and a bad flag refused before anything starts."""

from __future__ import annotations

from pathlib import Path

from tests.recipes.conftest import RunRecipe, is_png, metrics_rows, saved_checkpoint, summary

TINY = ("--train-size", "16", "--batch-size", "4", "--eval-size", "4", "--max-tokens", "4",
        "--save-every", "2", "--learning-rate", "1e-2", "--beta", "0.5",
        "--desirable-weight", "1.2", "--undesirable-weight", "0.8")  # fmt: skip
SUMMARY_KEYS = ("eval_reward_margin", "eval_desirable_reward", "eval_undesirable_reward",
                "eval_accuracy", "eval_answer_rate")  # fmt: skip


def test_a_run_logs_every_step_evaluates_and_draws_its_curve(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    log_dir = tmp_path
    done = run_recipe("kto", *TINY, "--steps", "4", "--eval-every", "2", log_dir=log_dir)
    rows = metrics_rows(log_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_reward_margin" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [0, 2, 4]
    # Before the first update the policy is the reference: every log-ratio is 0 up to the float
    # noise between a training forward pass and the sampler, z_ref too, and each example costs
    # half its weight: the mean of 1.2 / 2 and 0.8 / 2 over a batch, which lies between them.
    first = train[0]
    assert abs(first["kl"]) < 1e-3 and abs(evals[0]["eval_kl"]) < 1e-3
    assert 0.4 - 1e-4 <= first["loss"] <= 0.6 + 1e-4
    assert abs(evals[0]["eval_loss"] - 0.5) < 1e-4  # the held-out examples are half desirable
    assert abs(evals[0]["eval_reward_margin"]) < 1e-3 and evals[0]["eval_accuracy"] == 0.0
    for r in evals:
        assert r["eval_reward_margin"] == r["eval_desirable_reward"] - r["eval_undesirable_reward"]
        assert 0 <= r["eval_accuracy"] <= 1 and 0 <= r["eval_answer_rate"] <= 1
    assert all(r["kl"] >= 0 for r in train)  # z_ref is clamped at 0
    # After the first update the policy has left the reference: the log-ratios are no longer 0.
    # (Learning on held-out data is shown by the SmolLM2 run in docs/recipes/kto.md; the random
    # tiny model's batch loss moves with each batch's mix of labels.)
    assert (
        max(abs(r[k]) for r in train[1:] for k in ("desirable_reward", "undesirable_reward")) > 0.01
    )
    assert abs(evals[-1]["eval_reward_margin"]) > 0.01
    assert is_png(log_dir / "curve.png")
    checkpoint = saved_checkpoint(log_dir)
    assert checkpoint["step"] == 4 and checkpoint["state"].startswith("tinker://")
    result = summary(done)
    for key in SUMMARY_KEYS:
        assert result[f"{key}_before"] == evals[0][key]
        assert result[f"{key}_after"] == evals[-1][key]


def test_resume_continues_from_the_checkpoint_with_the_same_reference(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_recipe("kto", *TINY, "--steps", "4", "--eval-every", "0", log_dir=whole)
    run_recipe("kto", *TINY, "--steps", "2", "--eval-every", "0", log_dir=parts)
    run_recipe("kto", *TINY, "--steps", "4", "--eval-every", "0", "--resume", log_dir=parts)
    got = {r["step"]: r for r in metrics_rows(parts) if "loss" in r}
    expected = {r["step"]: r for r in metrics_rows(whole) if "loss" in r}
    assert sorted(got) == [1, 2, 3, 4]
    # Steps 3-4 ran in a session loaded from the step-2 checkpoint, on the same examples, against
    # the same reference (the base model): the same losses and KL estimates.
    for step in (3, 4):
        for key in ("loss", "kl"):
            assert abs(got[step][key] - expected[step][key]) < 1e-4, (step, key, got, expected)


def test_a_batch_of_one_is_refused_with_the_reason(run_recipe: RunRecipe, tmp_path: Path) -> None:
    done = run_recipe("kto", "--batch-size", "1", log_dir=tmp_path, expect=2)
    assert "--batch-size: must be 2 or more, not 1" in done.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
