"""The recipes' shared layer (treadle/recipes/common): data order, advantages, datums, the
metrics file across a resume, the curve, and the run folder's refusals."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from treadle.recipes.common import metrics, options
from treadle.recipes.common.advantages import group_centred, reverse_kl
from treadle.recipes.common.batching import batch_at, step_seed
from treadle.recipes.common.chat import datum
from treadle.recipes.common.runs import RunFolder, RunFolderError


def test_a_steps_batch_depends_only_on_the_seed_and_the_step() -> None:
    items = list(range(10))
    run = [batch_at(items, 4, seed=3, step=s) for s in range(5)]
    assert run == [batch_at(items, 4, seed=3, step=s) for s in range(5)]
    assert batch_at(items, 4, seed=3, step=2) != batch_at(items, 4, seed=4, step=2)
    # Each epoch is a permutation: 20 items read from steps 0-4 cover every item twice.
    assert sorted(x for batch in run for x in batch) == sorted(items * 2)


def test_step_seeds_differ_by_step_and_part_and_fit_31_bits() -> None:
    seeds = {step_seed(0, step, part) for step in range(20) for part in range(20)}
    assert len(seeds) == 400 and max(seeds) < 2**31


def test_group_centred_advantages_sum_to_zero_and_ties_say_nothing() -> None:
    assert group_centred([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert group_centred([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_centred([1.0, 0.0], normalise=True) == [1.0, -1.0]
    assert group_centred([0.0, 0.0], normalise=True) == [0.0, 0.0]


def test_reverse_kl_advantage_is_teacher_minus_student_per_token() -> None:
    assert reverse_kl([-1.0, -2.0], [-0.5, -3.0]) == [0.5, -1.0]
    with pytest.raises(ValueError, match="2 student logprobs but 1 teacher"):
        reverse_kl([-1.0, -2.0], [-0.5])


def test_a_datum_shifts_targets_and_pads_per_token_inputs_over_the_prompt() -> None:
    d = datum([10, 11, 12], [13, 14], advantages=[0.5, 0.5], logprobs=[-1.0, -2.0])
    assert d.model_input.to_ints() == [10, 11, 12, 13]
    assert d.loss_fn_inputs["target_tokens"].data == [11, 12, 13, 14]
    assert d.loss_fn_inputs["advantages"].data == [0.0, 0.0, 0.5, 0.5]
    assert d.loss_fn_inputs["logprobs"].data == [0.0, 0.0, -1.0, -2.0]
    with pytest.raises(ValueError, match="weights has 1 values for a completion of 2 tokens"):
        datum([10, 11], [12, 13], weights=[1.0])


def _args(tmp_path: Path, **flags: bool) -> argparse.Namespace:
    """A recipe's parsed command line with --log-dir `tmp_path` and the on/off `flags`."""
    argv = ["--embedded", "--log-dir", str(tmp_path), *(f"--{f}" for f, on in flags.items() if on)]
    return options.parse(options.parser("demo", "a recipe", steps=4, learning_rate=1e-3), argv)


def test_a_resumed_metrics_file_keeps_rows_up_to_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = metrics.MetricsLog(path, start_step=0, total_steps=4, progress=False, shown=["loss"])
    for step in range(1, 5):
        log.record(step, loss=1.0 / step)
    log.close()
    resumed = metrics.MetricsLog(path, start_step=2, total_steps=4, progress=False, shown=[])
    resumed.record(3, loss=0.0)
    resumed.close()
    assert [(r["step"], r["loss"]) for r in metrics.read(path)] == [(1, 1.0), (2, 0.5), (3, 0.0)]
    assert metrics.first(metrics.read(path), "loss") == 1.0


def test_the_curve_is_a_png_with_sparse_and_dense_metrics(tmp_path: Path) -> None:
    rows = [{"step": s, "loss": 1.0 / (s + 1)} for s in range(6)] + [{"step": 5, "acc": 0.5}]
    metrics.plot(rows, tmp_path / "c.png", "t", {"loss": ["loss"], "acc": ["acc", "missing"]})
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_the_run_folder_refuses_to_mix_runs_and_to_resume_nothing(tmp_path: Path) -> None:
    with pytest.raises(RunFolderError, match="has no checkpoint.json"):
        RunFolder(_args(tmp_path, resume=True))
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunFolderError, match="already holds a run"):
        RunFolder(_args(tmp_path))
    assert RunFolder(_args(tmp_path, overwrite=True)).start_step == 0
    assert not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "checkpoint.json").write_text(json.dumps({"step": 7, "state": "tinker://m/w/x"}))
    folder = RunFolder(_args(tmp_path, resume=True))
    assert folder.start_step == 7 and folder.resumed_from is not None
    assert folder.resumed_from.state == "tinker://m/w/x"


def test_last_is_the_latest_value_of_a_metric() -> None:
    rows = [{"step": 0, "acc": 0.1}, {"step": 1, "loss": 2.0}, {"step": 2, "acc": 0.7}]
    assert metrics.last(rows, "acc") == 0.7 and metrics.last(rows, "missing") is None


def test_a_negative_count_is_refused_with_the_value() -> None:
    assert options.non_negative("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="must be 0 or more, not -1"):
        options.non_negative("-1")
