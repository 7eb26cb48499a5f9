"""dpo end to end on tiny-debug: per-step metrics, held-out evaluation, the curve, checkpoints,
--resume, and the reference the recipe takes from the base model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import treadle
from tests.conftest import Platform
from tests.recipes.conftest import RunRecipe, is_png, metrics_rows, saved_checkpoint, summary
from treadle.recipes import dpo_data
from treadle.recipes.dpo import reference_logprobs, tokenise

TINY = ("--train-size", "16", "--batch-size", "2", "--eval-size", "3", "--max-tokens", "4",
        "--save-every", "2", "--learning-rate", "1e-2")  # fmt: skip


def test_a_run_logs_every_step_evaluates_and_draws_its_curve(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    log_dir = tmp_path
    done = run_recipe("dpo", *TINY, "--steps", "4", "--eval-every", "2", log_dir=log_dir)
    rows = metrics_rows(log_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [0, 2, 4]
    # Before the first update the policy is the reference: every margin is 0 (up to the float
    # noise between a training forward pass and the sampler) and the loss is log 2.
    assert abs(train[0]["loss"] - math.log(2)) < 1e-4 and abs(train[0]["margin"]) < 1e-3
    assert abs(evals[0]["eval_margin"]) < 1e-3
    # A high learning rate on two pairs a step: the batch's margin grows.
    assert train[-1]["margin"] > 0.01 and train[-1]["loss"] < math.log(2)
    assert all(0 <= r[k] <= 1 for r in evals for k in ("eval_accuracy", "eval_answer_rate"))
    assert is_png(log_dir / "curve.png")
    checkpoint = saved_checkpoint(log_dir)
    assert checkpoint["step"] == 4 and checkpoint["state"].startswith("tinker://")
    result = summary(done)
    for key in ("eval_accuracy", "eval_margin", "eval_prefers_chosen", "eval_answer_rate"):
        assert result[f"{key}_before"] == evals[0][key]
        assert result[f"{key}_after"] == evals[-1][key]


def test_resume_continues_from_the_checkpoint_with_the_same_reference(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_recipe("dpo", *TINY, "--steps", "4", "--eval-every", "0", log_dir=whole)
    run_recipe("dpo", *TINY, "--steps", "2", "--eval-every", "0", log_dir=parts)
    run_recipe("dpo", *TINY, "--steps", "4", "--eval-every", "0", "--resume", log_dir=parts)
    got = {r["step"]: r for r in metrics_rows(parts) if "loss" in r}
    expected = {r["step"]: r for r in metrics_rows(whole) if "loss" in r}
    assert sorted(got) == [1, 2, 3, 4]
    # Steps 3-4 ran in a session loaded from the step-2 checkpoint (weights and Adam's moments),
    # on the same pairs, against the same reference (the base model): the same losses and margins.
    for step in (3, 4):
        for key in ("loss", "margin"):
            assert abs(got[step][key] - expected[step][key]) < 1e-4, (step, key, got, expected)
    assert saved_checkpoint(parts)["step"] == 4


def test_the_base_model_reference_equals_a_fresh_sessions_weights(platform: Platform) -> None:
    """Why the recipe takes its reference from the base model: a new LoRA (B = 0) is the base
    model, so a fresh run and a resumed one score pairs against the same reference."""
    svc = treadle.ServiceClient(base_url=platform.base_url, api_key=platform.admin_key)
    try:
        tc = svc.create_lora_training_client("treadle/tiny-debug", rank=4, seed=5)
        tokenizer = tc.get_tokenizer()
        pairs = [tokenise(tokenizer, p) for p in dpo_data.pairs(3, seed=1)]
        fresh = reference_logprobs(tc.save_weights_and_get_sampling_client(), pairs)
        base = reference_logprobs(
            svc.create_sampling_client(base_model="treadle/tiny-debug"), pairs
        )
    finally:
        svc.close()
    assert all(c < 0 and r < 0 for c, r in fresh)
    flat = [lp for pair in fresh for lp in pair]
    assert [lp for pair in base for lp in pair] == pytest.approx(flat, abs=1e-5)
