"""Recipe tests: each recipe runs end to end as a user runs it (`python -m treadle.recipes.<name>`,
a process of its own) against the session's platform, on `treadle/tiny-debug` with tiny settings.

Marked `recipes` (not `integration`): CI's second pass over the integration tier, against the
machine's own PostgreSQL and Redis, does not run them again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Platform

RECIPE_TIMEOUT_S = 300


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.recipes)


RunRecipe = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_recipe(platform: Platform) -> RunRecipe:
    """`run_recipe("sft", "--steps", "2", log_dir=d, client="tinker")` runs the recipe against the
    platform; it fails the test (with the recipe's output) unless the exit status is `expect`."""

    def run(
        name: str, *args: str, log_dir: Path, client: str = "treadle", expect: int = 0
    ) -> subprocess.CompletedProcess[str]:
        # A user's shell, not this test process's: other test modules set HF_HUB_OFFLINE and
        # the like in os.environ, and the recipe sets the hub variables it needs itself.
        env = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("TINKER_", "TREADLE_", "HF_", "TRANSFORMERS_"))
        }  # fmt: skip
        command = [
            sys.executable, "-m", f"treadle.recipes.{name}",
            "--base-url", platform.base_url, "--api-key", platform.admin_key,
            "--client", client, "--model", "treadle/tiny-debug",
            "--log-dir", str(log_dir), "--no-progress", *args,
        ]  # fmt: skip
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S
        )
        if done.returncode != expect:
            pytest.fail(
                f"{' '.join(command)} exited {done.returncode}, expected {expect}\n"
                f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
            )
        return done

    return run


def metrics_rows(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def summary(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON object a recipe prints as its last line of output."""
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def saved_checkpoint(log_dir: Path) -> dict[str, Any]:
    """The run folder's checkpoint.json: the newest checkpoint's step and state path."""
    return dict(json.loads((log_dir / "checkpoint.json").read_text()))
