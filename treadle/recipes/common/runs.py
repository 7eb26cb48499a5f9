"""The run folder: which step the run has reached, its configuration, its checkpoints, and
--resume.

config.json records every flag's value (run_config); a resumed run must match it unless told
otherwise. A checkpoint is `save_state` (adapter and optimizer state on the platform) plus `checkpoint.json`
here naming it and the step it was taken after. Data order, sampling seeds and evaluation all
derive from (seed, step), so a resumed run continues exactly where the checkpoint left it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.recipes.common import metrics, options, run_config
from treadle.recipes.common.connect import ready
from treadle.recipes.common.tracking import RUN_FILE, Tracker

CHECKPOINT = "checkpoint.json"
RUN_FILES = ("metrics.jsonl", "curve.png", CHECKPOINT, run_config.FILE, RUN_FILE)


class RunFolderError(ValueError):
    """The run folder does not fit the flags (a run exists without --resume, or none with it,
    or a resumed run's configuration changed)."""


@dataclass(frozen=True)
class Checkpoint:
    step: int  # optimizer steps taken before the save
    state: str  # tinker://<model_id>/weights/<name>: weights and optimizer state

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "state": self.state}


def open_run(
    p: argparse.ArgumentParser, argv: list[str] | None = None
) -> tuple[argparse.Namespace, RunFolder]:
    """Parse the command line and open --log-dir; a folder that does not fit the flags is a
    usage error (exit status 2, with what to do)."""
    args = options.parse(p, argv)
    try:
        return args, RunFolder(args)
    except RunFolderError as e:
        p.error(str(e))


class RunFolder:
    """`--log-dir`: opened for a fresh run (refusing to mix with an old one) or a resumed one."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.path: Path = args.log_dir
        self.name = self.path.name
        self.resumed_from = self._open(resume=args.resume, overwrite=args.overwrite)
        config = run_config.resolved(args)
        if self.resumed_from:
            self._check_config(config, allow_change=args.allow_config_change)
        run_config.write(self.path / run_config.FILE, config)
        self.tracker = Tracker.start(
            args.mlflow_uri, args.mlflow_experiment, self.path, config,
            resumed=self.resumed_from is not None,
        )  # fmt: skip

    @property
    def start_step(self) -> int:
        return self.resumed_from.step if self.resumed_from else 0

    def _open(self, *, resume: bool, overwrite: bool) -> Checkpoint | None:
        existing = [f for f in RUN_FILES if (self.path / f).exists()]
        if resume:
            if not (self.path / CHECKPOINT).exists():
                raise RunFolderError(
                    f"--resume: {self.path} has no {CHECKPOINT}; the run saved no checkpoint yet "
                    "(see --save-every), so start it again without --resume"
                )
            saved = json.loads((self.path / CHECKPOINT).read_text())
            return Checkpoint(step=int(saved["step"]), state=str(saved["state"]))
        if existing and not overwrite:
            raise RunFolderError(
                f"{self.path} already holds a run ({', '.join(existing)}): pass --resume to "
                "continue it, --overwrite to start afresh, or another --log-dir"
            )
        for f in existing:
            (self.path / f).unlink()
        shutil.rmtree(self.path / "samples", ignore_errors=True)
        self.path.mkdir(parents=True, exist_ok=True)
        return None

    def _check_config(self, config: dict[str, Any], *, allow_change: bool) -> None:
        """A resumed run continues the recorded configuration, or is told it may change."""
        path = self.path / run_config.FILE
        if not path.exists():  # a run from before config.json was written
            return
        changed = run_config.changes(run_config.read(path), config)
        if changed and not allow_change:
            raise RunFolderError(
                f"--resume: the configuration differs from {path} in {'; '.join(changed)}. "
                "Leave those flags out to continue as recorded, or pass --allow-config-change "
                "to continue with the new values"
            )

    def training_client(self, svc: Any, args: argparse.Namespace) -> Any:
        """A new LoRA session, or one loaded from the checkpoint (weights and optimizer)."""
        if self.resumed_from:
            state = self.resumed_from.state
            tc = ready(svc.create_training_client_from_state_with_optimizer(state))
        else:
            tc = ready(svc.create_lora_training_client(args.model, rank=args.rank, seed=args.seed))
        self.tracker.tag_session(str(tc.model_id))
        return tc

    def save(self, tc: Any, step: int) -> Checkpoint:
        """save_state after `step` optimizer steps; checkpoint.json is replaced atomically."""
        path = tc.save_state(f"{self.name}-step-{step:06d}").result().path
        checkpoint = Checkpoint(step=step, state=str(path))
        tmp = self.path / (CHECKPOINT + ".tmp")
        tmp.write_text(json.dumps(checkpoint.to_json(), indent=2) + "\n")
        os.replace(tmp, self.path / CHECKPOINT)
        return checkpoint

    def metrics_log(self, args: argparse.Namespace, shown: Sequence[str]) -> metrics.MetricsLog:
        """metrics.jsonl, opened at this run's step (a resumed run keeps the rows up to it)."""
        return metrics.MetricsLog(
            self.path / "metrics.jsonl", start_step=self.start_step, total_steps=args.steps,
            progress=not args.no_progress, shown=shown, sink=self.tracker.log_row,
        )  # fmt: skip

    def step_done(
        self,
        tc: Any,
        done: int,
        args: argparse.Namespace,
        log: metrics.MetricsLog,
        evaluate: Callable[[int], object],
    ) -> None:
        """After optimizer step `done`: the bar moves, an evaluation every --eval-every steps
        (the last step's is the recipe's own, after its loop) and a checkpoint every
        --save-every steps and after the last."""
        log.advance()
        if args.eval_every and done % args.eval_every == 0 and done < args.steps:
            evaluate(done)
        if done == args.steps or (args.save_every > 0 and done % args.save_every == 0):
            self.save(tc, done)

    def finish(
        self,
        title: str,
        panels: dict[str, list[str]],
        summary: Callable[[list[dict[str, Any]]], dict[str, Any]],
    ) -> None:
        """Draw curve.png from metrics.jsonl, hand the run's files to the tracker and print the
        run's summary (computed from the rows, so a resumed run reports the evaluation its first
        half made) as the last line."""
        rows = metrics.read(self.path / "metrics.jsonl")
        metrics.plot(rows, self.path / "curve.png", title, panels)
        checkpoint = self.path / CHECKPOINT
        state = json.loads(checkpoint.read_text())["state"] if checkpoint.exists() else None
        self.tracker.finish(self.path, ("curve.png", run_config.FILE, CHECKPOINT), state)
        print(json.dumps({**summary(rows), "log_dir": str(self.path)}))
