"""MLflow tracking of a run (--mlflow-uri): its parameters (config.json), every metrics.jsonl
row's numbers at the row's step, and at the end the curve, config.json and checkpoint.json as
artifacts with the final checkpoint's path as a tag (`checkpoint`). The platform session the
loop trains is tagged too (`treadle.session_id`), so that the platform's own run for it
(docs/operations.md, "MLflow") can be found beside the loop's.

The MLflow run's id is kept in the run folder (mlflow.json): a resumed run continues it. A
tracking server that cannot be reached, at the start or later, is reported once on stderr and
the run goes on without it; metrics.jsonl still has every row.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUN_FILE = "mlflow.json"

# Importing mlflow otherwise sets loggers of the process's own (`sqlalchemy.engine`, `alembic`)
# to WARNING with a handler of its own; a recipe's logging stays the process's.
os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")


class Tracker:
    """The run's MLflow run; does nothing without --mlflow-uri or once the server has failed."""

    def __init__(self, uri: str | None) -> None:
        self.uri = uri
        self.run_id: str | None = None
        self._client: Any = None

    @classmethod
    def start(
        cls, uri: str | None, experiment: str, folder: Path, params: dict[str, Any], *,
        resumed: bool,
    ) -> Tracker:  # fmt: skip
        """Start the run's MLflow run (continue the one mlflow.json names when resuming on the
        same server) and log `params`; nothing without `uri`."""
        tracker = cls(uri)
        if uri:
            tracker._open(uri, experiment, folder, params, resumed=resumed)
        return tracker

    def _open(
        self, uri: str, experiment: str, folder: Path, params: dict[str, Any], *, resumed: bool
    ) -> None:
        # A server that does not answer costs a few seconds here, not MLflow's default of
        # seven retries of two minutes each; an explicit setting wins.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        saved = _read(folder / RUN_FILE)
        with self._guard():
            if resumed and saved.get("tracking_uri") == uri and saved.get("run_id"):
                self.run_id = str(saved["run_id"])
                self._client.update_run(self.run_id, status="RUNNING")
                kept = self._client.get_run(self.run_id).data.params
            else:
                found = self._client.get_experiment_by_name(experiment)
                experiment_id = (
                    found.experiment_id if found else self._client.create_experiment(experiment)
                )
                run = self._client.create_run(experiment_id, run_name=folder.name)
                self.run_id, kept = run.info.run_id, {}
                (folder / RUN_FILE).write_text(
                    json.dumps({"tracking_uri": uri, "run_id": self.run_id}, indent=2) + "\n"
                )
            # A parameter's value cannot change on an MLflow run: a resumed run that was let
            # change its configuration logs only the new keys (config.json has the values).
            self._log(params={k: _param(v) for k, v in params.items() if k not in kept})

    def tag_session(self, session_id: str) -> None:
        """The platform session (training run) the loop trains."""
        self._log(tags={"treadle.session_id": session_id})

    def log_row(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl row: its numbers (not its texts) at its step."""
        numbers = {k: v for k, v in row.items() if k != "step" and _is_number(v)}
        if numbers:
            self._log(metrics=numbers, step=int(row["step"]))

    def finish(self, folder: Path, files: tuple[str, ...], checkpoint: str | None) -> None:
        """The run's files as artifacts, the final checkpoint's path as a tag; the run ends."""
        if self._client is None:
            return
        with self._guard():
            if checkpoint is not None:
                self._client.set_tag(self.run_id, "checkpoint", checkpoint)
            for name in files:
                if (folder / name).exists():
                    self._client.log_artifact(self.run_id, str(folder / name))
            self._client.set_terminated(self.run_id)

    def _log(
        self,
        *,
        metrics: dict[str, float] | None = None,
        step: int = 0,
        params: dict[str, str] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        if self._client is None:
            return
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        with self._guard():
            self._client.log_batch(
                self.run_id,
                metrics=[Metric(k, float(v), now, step) for k, v in (metrics or {}).items()],
                params=[Param(k, v) for k, v in (params or {}).items()],
                tags=[RunTag(k, v) for k, v in (tags or {}).items()],
            )

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """A failure of the tracking server inside becomes one warning and no more tracking."""
        from mlflow.exceptions import MlflowException

        try:
            yield
        except (MlflowException, OSError) as error:
            print(
                f"warning: MLflow at {self.uri} failed ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:300]}); the run goes on without it, its metrics "
                "are in metrics.jsonl",
                file=sys.stderr,
                flush=True,
            )
            self._client = None


def _read(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.exists() else {}


def _param(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
