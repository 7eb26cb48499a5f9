"""distill end to end on tiny-debug: a teacher made by the recipe, per-step metrics, the curve,
checkpoints, and --resume continuing from the saved step with the run's own teacher."""

from __future__ import annotations

import json
from pathlib import Path

from tests.recipes.conftest import RunRecipe, is_png, metrics_rows, saved_checkpoint, summary

TINY = ("--train-size", "8", "--batch-size", "2", "--samples-per-prompt", "2", "--eval-size", "1",
        "--max-tokens", "4", "--teacher-steps", "1", "--save-every", "1")  # fmt: skip


def test_a_run_makes_its_teacher_distils_and_resumes_from_its_checkpoint(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    done = run_recipe("distill", *TINY, "--steps", "2", "--eval-every", "0", log_dir=whole)
    assert "training a teacher: 1 supervised steps" in done.stderr
    teacher = json.loads((whole / "teacher.json").read_text())
    assert teacher["path"].startswith("tinker://") and "/sampler_weights/" in teacher["path"]
    assert teacher["trained_steps"] == 1
    rows = metrics_rows(whole)
    assert [r["step"] for r in rows if "reverse_kl" in r] == [1, 2]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 2]
    assert all(r["teacher_accuracy"] == teacher["accuracy"] for r in rows if "eval_accuracy" in r)
    assert all(r["reply_tokens"] > 0 for r in rows if "reply_tokens" in r)
    assert is_png(whole / "curve.png")
    assert saved_checkpoint(whole)["step"] == 2
    result = summary(done)
    assert result["teacher"] == teacher["path"]
    assert result["reverse_kl_first"] == rows[1]["reverse_kl"]
    assert result["held_out_accuracy_after"] == rows[-1]["eval_accuracy"]

    # The same distillation from that teacher, stopped after step 1 and resumed: --resume reads
    # the teacher from the folder (it trains none) and step 2 samples and scores exactly what
    # the uninterrupted run did, from the step-1 checkpoint.
    first = ("distill", *TINY, "--steps", "1", "--eval-every", "0")
    run_recipe(*first, "--teacher", teacher["path"], log_dir=parts)
    resumed = run_recipe("distill", *TINY, "--steps", "2", "--eval-every", "0", "--resume",
                         log_dir=parts)  # fmt: skip
    assert "training a teacher" not in resumed.stderr
    # Evaluated before step 0 and after each part; the resumed part does not evaluate step 1 again.
    assert [r["step"] for r in metrics_rows(parts) if "eval_accuracy" in r] == [0, 1, 2]
    assert summary(resumed)["held_out_accuracy_before"] == metrics_rows(parts)[0]["eval_accuracy"]
    assert json.loads((parts / "teacher.json").read_text())["path"] == teacher["path"]
    kl = {r["step"]: r["reverse_kl"] for r in metrics_rows(parts) if "reverse_kl" in r}
    expected = {r["step"]: r["reverse_kl"] for r in rows if "reverse_kl" in r}
    assert sorted(kl) == [1, 2]
    for step in (1, 2):
        assert abs(kl[step] - expected[step]) < 1e-4, (step, kl[step], expected[step])
    assert saved_checkpoint(parts)["step"] == 2


def test_resume_refuses_a_different_teacher(run_recipe: RunRecipe, tmp_path: Path) -> None:
    # A run folder as a run leaves it after its first checkpoint; the refusal comes before any
    # request, so the paths need not exist on the platform.
    teacher = {"path": "tinker://teacher/sampler_weights/t", "accuracy": 0.5, "trained_steps": 1}
    (tmp_path / "teacher.json").write_text(json.dumps(teacher))
    (tmp_path / "checkpoint.json").write_text(
        json.dumps({"step": 1, "state": "tinker://s/weights/x"})
    )
    done = run_recipe("distill", *TINY, "--steps", "2", "--resume", "--teacher",
                      "tinker://other/sampler_weights/x", log_dir=tmp_path, expect=2)  # fmt: skip
    assert "own teacher" in done.stderr and str(tmp_path / "teacher.json") in done.stderr
    assert json.loads((tmp_path / "teacher.json").read_text()) == teacher
