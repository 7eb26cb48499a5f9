"""A recipe run tracked in a real MLflow server (tests/mlflow_server.py): its metrics read back
with MlflowClient equal metrics.jsonl; an unreachable server is reported once and the run goes
on; a resumed run with a changed configuration is refused."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow import MlflowClient

from tests.recipes.conftest import RunRecipe, metrics_rows, saved_checkpoint
from treadle.platform.embedded import free_port

TINY = ("--train-size", "16", "--batch-size", "2", "--eval-size", "2", "--max-tokens", "4")


def test_a_tracked_run_leaves_its_metrics_params_curve_and_checkpoint_in_mlflow(
    run_recipe: RunRecipe, mlflow_uri: str, tmp_path: Path
) -> None:
    run_recipe("sft", *TINY, "--steps", "2", "--eval-every", "0", "--mlflow-uri", mlflow_uri,
               "--mlflow-experiment", "sft-tracked", log_dir=tmp_path)  # fmt: skip
    client = MlflowClient(tracking_uri=mlflow_uri)
    run = client.get_run(json.loads((tmp_path / "mlflow.json").read_text())["run_id"])
    rows = metrics_rows(tmp_path)
    numbers = {k for row in rows for k, v in row.items() if k != "step" and not isinstance(v, str)}
    assert {"loss", "eval_accuracy", "elapsed_s"} <= numbers
    for key in numbers:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == sorted((r["step"], r[key]) for r in rows if key in r), key
    assert run.data.params["learning_rate"] == "0.0005" and run.data.params["batch_size"] == "2"
    assert run.data.tags["checkpoint"] == saved_checkpoint(tmp_path)["state"]
    assert run.data.tags["treadle.session_id"]
    assert run.info.status == "FINISHED"
    names = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"curve.png", "config.json", "checkpoint.json"} <= names


def test_an_unreachable_mlflow_is_reported_once_and_the_run_goes_on(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    done = run_recipe("sft", *TINY, "--steps", "2", "--eval-every", "0", "--mlflow-uri", nowhere,
                      log_dir=tmp_path)  # fmt: skip
    assert done.stderr.count(f"warning: MLflow at {nowhere} failed") == 1
    assert [r["step"] for r in metrics_rows(tmp_path) if "loss" in r] == [1, 2]
    assert saved_checkpoint(tmp_path)["step"] == 2


def test_resume_with_a_changed_configuration_is_refused(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    run_recipe("sft", *TINY, "--steps", "1", "--eval-every", "0", log_dir=tmp_path)
    done = run_recipe("sft", "--resume", "--steps", "2", "--learning-rate", "0.01",
                      log_dir=tmp_path, expect=2)  # fmt: skip
    assert "learning_rate: 0.0005 -> 0.01" in done.stderr
    assert "--allow-config-change" in done.stderr
    assert json.loads((tmp_path / "config.json").read_text())["learning_rate"] == 0.0005
