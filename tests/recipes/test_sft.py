"""sft end to end on tiny-debug: per-step metrics, the curve, checkpoints, --resume, and the
refusals a user meets first (no platform, a folder that already holds a run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.recipes.conftest import RunRecipe, is_png, metrics_rows, saved_checkpoint, summary

TINY = ("--train-size", "16", "--batch-size", "2", "--eval-size", "3", "--max-tokens", "6")


def test_a_run_logs_every_step_evaluates_and_draws_its_curve(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    done = run_recipe("sft", *TINY, "--steps", "3", "--eval-every", "2", "--save-every", "2",
                      log_dir=tmp_path)  # fmt: skip
    rows = metrics_rows(tmp_path)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 2, 3]
    assert all(r["loss"] > 0 for r in rows if "loss" in r)
    assert is_png(tmp_path / "curve.png")
    checkpoint = saved_checkpoint(tmp_path)
    assert checkpoint["step"] == 3 and checkpoint["state"].startswith("tinker://")
    result = summary(done)
    assert result["held_out_accuracy_before"] == rows[0]["eval_accuracy"]
    assert result["held_out_accuracy_after"] == rows[-1]["eval_accuracy"]


def test_resume_continues_from_the_checkpoint_with_the_same_data(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_recipe("sft", *TINY, "--steps", "4", "--save-every", "2", "--eval-every", "0",
               log_dir=whole)  # fmt: skip
    run_recipe("sft", *TINY, "--steps", "2", "--save-every", "2", "--eval-every", "0",
               log_dir=parts)  # fmt: skip
    run_recipe("sft", *TINY, "--steps", "4", "--save-every", "2", "--eval-every", "0", "--resume",
               log_dir=parts)  # fmt: skip
    losses = {r["step"]: r["loss"] for r in metrics_rows(parts) if "loss" in r}
    expected = {r["step"]: r["loss"] for r in metrics_rows(whole) if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4]
    # Steps 3-4 ran in a new session loaded from the step-2 checkpoint (weights and Adam's
    # moments), on the batches of steps 3-4: the same losses as the uninterrupted run.
    for step in (3, 4):
        assert abs(losses[step] - expected[step]) < 1e-4, (step, losses[step], expected[step])
    assert saved_checkpoint(parts)["step"] == 4


def test_a_folder_holding_a_run_is_not_mixed_with_a_new_one(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    run_recipe("sft", *TINY, "--steps", "1", "--eval-every", "0", log_dir=tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    done = run_recipe("sft", *TINY, "--steps", "1", log_dir=tmp_path, expect=2)
    assert "already holds a run" in done.stderr and "--resume" in done.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_without_a_platform_it_says_how_to_name_one(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "treadle.recipes.sft", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 2
    assert "--embedded" in done.stderr and "--base-url" in done.stderr
