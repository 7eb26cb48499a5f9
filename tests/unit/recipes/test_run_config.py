"""A recipe's configuration (treadle/recipes/common/run_config, options, runs), in process: the
run folder's config.json holds every flag's value, --config supplies values the command line
overrides, and --resume refuses a changed configuration unless told it may change."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from treadle.recipes.common import options
from treadle.recipes.common.runs import open_run


def recipe_parser() -> argparse.ArgumentParser:
    """The shared flags and one of a recipe's own, as a recipe's main builds them."""
    p = options.parser("demo", "a recipe", steps=4, learning_rate=5e-4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--loss", choices=["ppo", "cispo"], default="ppo")
    return p


def opened(log_dir: Path, *argv: str) -> argparse.Namespace:
    args, _ = open_run(recipe_parser(), ["--log-dir", str(log_dir), "--embedded", *argv])
    return args


def config_of(log_dir: Path) -> dict[str, object]:
    return dict(json.loads((log_dir / "config.json").read_text()))


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The usage error open_run exits with (status 2)."""
    with pytest.raises(SystemExit) as exited:
        open_run(recipe_parser(), list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_config_json_holds_every_flag_but_the_api_key(tmp_path: Path) -> None:
    args, _ = open_run(
        recipe_parser(),
        ["--log-dir", str(tmp_path), "--base-url", "http://x", "--api-key", "tml-secret",
         "--learning-rate", "0.001", "--loss", "cispo"],
    )  # fmt: skip
    recorded = config_of(tmp_path)
    assert set(recorded) == set(vars(args)) - {"api_key"}
    assert recorded["learning_rate"] == 0.001 and recorded["loss"] == "cispo"
    assert recorded["batch_size"] == 8 and recorded["log_dir"] == str(tmp_path)
    assert "tml-secret" not in (tmp_path / "config.json").read_text()


def test_config_file_supplies_values_and_the_command_line_wins(tmp_path: Path) -> None:
    first = tmp_path / "first"
    opened(first, "--learning-rate", "0.002", "--batch-size", "3", "--loss", "cispo")
    args = opened(tmp_path / "second", "--config", str(first / "config.json"), "--batch-size", "5")
    assert args.learning_rate == 0.002 and args.loss == "cispo"  # from the file
    assert args.batch_size == 5  # the command line's
    assert args.log_dir == tmp_path / "second"


def test_a_config_file_with_an_unknown_key_or_a_bad_value_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"learning_rate": 0.1, "batch": 3}))
    err = refusal(capsys, "--embedded", "--log-dir", str(tmp_path / "a"), "--config", str(bad))
    assert "batch is not a flag" in err
    bad.write_text(json.dumps({"loss": "dpo"}))
    err = refusal(capsys, "--embedded", "--log-dir", str(tmp_path / "a"), "--config", str(bad))
    assert "--loss: invalid choice: 'dpo'" in err
    bad.write_text("[1, 2]")
    err = refusal(capsys, "--embedded", "--log-dir", str(tmp_path / "a"), "--config", str(bad))
    assert "expected a JSON object" in err


def checkpointed(log_dir: Path, *argv: str) -> None:
    """A run folder as a run of two steps leaves it (its checkpoint.json after step 2)."""
    opened(log_dir, *argv)
    (log_dir / "checkpoint.json").write_text(json.dumps({"step": 2, "state": "tinker://m/w/2"}))


def test_resume_continues_the_recorded_configuration(tmp_path: Path) -> None:
    checkpointed(tmp_path, "--learning-rate", "0.003", "--steps", "2")
    args = opened(tmp_path, "--resume", "--steps", "4")
    assert args.learning_rate == 0.003 and args.steps == 4
    assert config_of(tmp_path)["steps"] == 4


def test_resume_refuses_a_changed_configuration_naming_what_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpointed(tmp_path, "--learning-rate", "0.003", "--steps", "2")
    err = refusal(capsys, "--embedded", "--log-dir", str(tmp_path), "--resume",
                  "--learning-rate", "0.01", "--batch-size", "2")  # fmt: skip
    assert "learning_rate: 0.003 -> 0.01" in err and "batch_size: 8 -> 2" in err
    assert "--allow-config-change" in err
    assert config_of(tmp_path)["learning_rate"] == 0.003
    args = opened(tmp_path, "--resume", "--learning-rate", "0.01", "--allow-config-change")
    assert args.learning_rate == 0.01 and config_of(tmp_path)["learning_rate"] == 0.01
