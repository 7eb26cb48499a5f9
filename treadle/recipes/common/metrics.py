"""Per-step metrics: one JSON object per line in metrics.jsonl (each also handed to a sink: the
run's MLflow tracker), a progress bar showing the latest ones, and the learning curve drawn from
the file as a PNG (matplotlib, no screen needed).

A resumed run keeps the lines up to its checkpoint's step and drops the later ones (steps it is
about to run again), so the file always reads as one run.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm


class MetricsLog:
    """`log.record(step, loss=..., accuracy=...)`; rows with `step` = optimizer steps taken."""

    def __init__(
        self,
        path: Path,
        *,
        start_step: int,
        total_steps: int,
        progress: bool,
        shown: Sequence[str],
        sink: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.path = path
        self.shown = list(shown)
        self.sink = sink
        kept = [row for row in read(path) if row["step"] <= start_step] if start_step else []
        path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        # A resumed run's clock continues from where the kept rows end.
        self.started = time.monotonic() - (kept[-1]["elapsed_s"] if kept else 0.0)
        self.bar = tqdm(
            total=total_steps, initial=start_step, disable=not progress, file=sys.stderr,
            dynamic_ncols=True, unit="step",
        )  # fmt: skip

    def record(self, step: int, **metrics: float | int | str | None) -> dict[str, Any]:
        """Append one row (the bar shows the `shown` metrics); `advance()` moves the bar."""
        row = {"step": step, "elapsed_s": round(time.monotonic() - self.started, 3), **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.sink is not None:
            self.sink(row)
        latest = {k: _short(row[k]) for k in self.shown if row.get(k) is not None}
        if latest:
            self.bar.set_postfix(latest, refresh=False)
        return row

    def advance(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def first(rows: list[dict[str, Any]], key: str) -> Any:
    """The earliest value of `key` (e.g. the evaluation before training), or None."""
    return next((row[key] for row in rows if row.get(key) is not None), None)


def last(rows: list[dict[str, Any]], key: str) -> Any:
    """The latest value of `key` (e.g. the evaluation after training), or None."""
    return first(rows[::-1], key)


def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(rows: list[dict[str, Any]], path: Path, title: str, panels: dict[str, list[str]]) -> None:
    """One panel per entry (`{"held-out accuracy": ["eval_accuracy"], ...}`), metric vs step.

    A metric recorded only on some steps (an evaluation) is drawn with markers at those steps.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 3.6), squeeze=False)
    for ax, (label, keys) in zip(axes[0], panels.items(), strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if _is_number(r.get(key))]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            sparse = len(points) < 0.5 * len({r["step"] for r in rows})
            ax.plot(steps, values, marker="o" if sparse else None, label=key)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
