"""code_rl end to end on tiny-debug: per-step metrics with the staleness inside its limit, every
reply scored by the sandbox, the curve, a checkpoint, and --resume continuing from it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.recipes.conftest import RunRecipe, is_png, metrics_rows, saved_checkpoint, summary

TINY = ("--batch-size", "2", "--group-size", "2", "--max-tokens", "8", "--rank", "4")


def test_a_run_overlaps_sampling_within_the_staleness_limit_and_draws_its_curve(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    done = run_recipe("code_rl", *TINY, "--steps", "3", "--max-steps-off-policy", "1",
                      "--eval-every", "2", "--save-every", "2", log_dir=tmp_path)  # fmt: skip
    rows = metrics_rows(tmp_path)
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval_pass_rate" in r] == [0, 2, 3]
    # Step n (0-based) trains on weights n; its batch came from weights n - staleness.
    assert all(0 <= r["staleness"] <= 1 for r in steps)
    assert all(r["sampler_step"] == r["step"] - 1 - r["staleness"] for r in steps)
    # tiny-debug writes noise, never a code block: every reply earns -0.1.
    assert all(r["reward_mean"] == -0.1 and r["no_code_rate"] == 1.0 for r in steps)
    replies = [json.loads(line) for line in (tmp_path / "samples" / "step-000003.jsonl").open()]
    assert len(replies) == 4 and {r["outcome"] for r in replies} == {"no code"}
    assert is_png(tmp_path / "curve.png")
    checkpoint = saved_checkpoint(tmp_path)
    assert checkpoint["step"] == 3 and checkpoint["state"].startswith("tinker://")
    result = summary(done)
    assert result["max_staleness"] == max(r["staleness"] for r in steps)
    assert result["held_out_pass_rate_before"] == rows[0]["eval_pass_rate"]


def test_without_overlap_every_batch_is_on_policy(run_recipe: RunRecipe, tmp_path: Path) -> None:
    run_recipe("code_rl", *TINY, "--steps", "2", "--max-steps-off-policy", "0",
               "--eval-every", "0", "--save-every", "0", log_dir=tmp_path)  # fmt: skip
    steps = [r for r in metrics_rows(tmp_path) if "staleness" in r]
    assert [(r["step"], r["staleness"], r["sampler_step"]) for r in steps] == [(1, 0, 0), (2, 0, 1)]


def test_resume_continues_from_the_saved_step(run_recipe: RunRecipe, tmp_path: Path) -> None:
    run_recipe("code_rl", *TINY, "--steps", "1", "--eval-every", "0", log_dir=tmp_path)
    run_recipe("code_rl", *TINY, "--steps", "2", "--eval-every", "0", "--resume",
               log_dir=tmp_path)  # fmt: skip
    rows = metrics_rows(tmp_path)
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
    # The resumed run sampled its first batch from the checkpoint's weights (after step 1), and
    # did not evaluate step 1 again: the first run's evaluation there is kept.
    second = next(r for r in rows if r["step"] == 2 and "sampler_step" in r)
    assert second["sampler_step"] == 1 and second["staleness"] == 0
    assert [r["step"] for r in rows if "eval_pass_rate" in r] == [0, 1, 2]
    assert saved_checkpoint(tmp_path)["step"] == 2


def test_the_plain_tinker_sdk_drives_the_same_loop(run_recipe: RunRecipe, tmp_path: Path) -> None:
    run_recipe("code_rl", *TINY, "--steps", "2", "--eval-every", "0", client="tinker",
               log_dir=tmp_path)  # fmt: skip
    steps = [r for r in metrics_rows(tmp_path) if "staleness" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["staleness"] <= 1 for r in steps)
    assert saved_checkpoint(tmp_path)["step"] == 2
