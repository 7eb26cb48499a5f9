"""The run folder: which step the run has reached, its checkpoints, and --resume.

A checkpoint is `save_state` (adapter and optimizer state on the platform) plus `checkpoint.json`
here naming it and the step it was taken after. Data order, sampling seeds and evaluation all
derive from (seed, step), so a resumed run continues exactly where the checkpoint left it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.recipes.common.connect import ready

CHECKPOINT = "checkpoint.json"
RUN_FILES = ("metrics.jsonl", "curve.png", CHECKPOINT)


class RunFolderError(ValueError):
    """The run folder does not fit the flags (a run exists without --resume, or none with it)."""


@dataclass(frozen=True)
class Checkpoint:
    step: int  # optimizer steps taken before the save
    state: str  # tinker://<model_id>/weights/<name>: weights and optimizer state

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "state": self.state}


class RunFolder:
    """`--log-dir`: opened for a fresh run (refusing to mix with an old one) or a resumed one."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.path: Path = args.log_dir
        self.name = self.path.name
        self.resumed_from = self._open(resume=args.resume, overwrite=args.overwrite)

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

    def training_client(self, svc: Any, args: argparse.Namespace) -> Any:
        """A new LoRA session, or one loaded from the checkpoint (weights and optimizer)."""
        if self.resumed_from:
            state = self.resumed_from.state
            return ready(svc.create_training_client_from_state_with_optimizer(state))
        return ready(svc.create_lora_training_client(args.model, rank=args.rank, seed=args.seed))

    def save(self, tc: Any, step: int) -> Checkpoint:
        """save_state after `step` optimizer steps; checkpoint.json is replaced atomically."""
        path = tc.save_state(f"{self.name}-step-{step:06d}").result().path
        checkpoint = Checkpoint(step=step, state=str(path))
        tmp = self.path / (CHECKPOINT + ".tmp")
        tmp.write_text(json.dumps(checkpoint.to_json(), indent=2) + "\n")
        os.replace(tmp, self.path / CHECKPOINT)
        return checkpoint

    def is_checkpoint_step(self, step: int, every: int, last: int) -> bool:
        return step == last or (every > 0 and step % every == 0)
