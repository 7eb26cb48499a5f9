"""`python -m treadle.cookbook`: what the runner sets up before it runs a recipe's module (the
recipes themselves run against a platform in tests/compat/test_cookbook.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle import cookbook

SHOW = """import os, sys
print(sys.argv[1:], os.environ.get("TINKER_TELEMETRY"))
"""


def test_the_runner_runs_the_module_with_its_arguments_and_no_sdk_telemetry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "show_run.py").write_text(SHOW)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("sys.argv", ["cookbook"])
    monkeypatch.delenv("TINKER_TELEMETRY")
    cookbook.main(["show_run", "model_name=x", "max_steps=1"])
    assert capsys.readouterr().out == "['model_name=x', 'max_steps=1'] 0\n"

    monkeypatch.setenv("TINKER_TELEMETRY", "1")  # a user's own setting stands
    cookbook.main(["show_run"])
    assert capsys.readouterr().out == "[] 1\n"
