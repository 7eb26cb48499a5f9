"""Importing mlflow after the worker's MLflow publisher (or a recipe's tracker) leaves the
process's loggers alone: mlflow otherwise stops `sqlalchemy.engine` and `alembic` propagating,
and their records would leave the worker's log format."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import logging, sys
import {module}
import mlflow
names = ("sqlalchemy.engine", "alembic")
print(all(logging.getLogger(n).propagate and not logging.getLogger(n).handlers for n in names))
"""


@pytest.mark.parametrize(
    "module", ["treadle.platform.audit.mlflow_publisher", "treadle.recipes.common.tracking"]
)
def test_mlflow_takes_over_no_logger_of_the_process(module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_CONFIGURE_LOGGING"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
