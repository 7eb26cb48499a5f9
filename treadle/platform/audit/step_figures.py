"""A session's figures per optimizer step, from its audit timeline and its usage rows: pure, no
I/O. What the MLflow publisher (`mlflow_publisher`) sends, and what a test recomputes from the
audit route to check it.

Step n is the session's n-th completed `optim_step`. Its window is the session's ordered
operations requested after step n - 1's `optim_step`, up to and including its own; of those,
the completed ones count (a failed operation did nothing and cost nothing). Operations on a
sampler (unordered) are not in any window. Per step:
- `loss_sum`: the windows' forward_backward `loss:sum`, added (only when there was one)
- `train_tokens`, `prefill_tokens`, `sample_tokens`: the window's metered tokens by class
- `learning_rate`, `grad_norm`: the optim_step's own (`learning_rate:mean`, `grad_norm:mean`)
- `cost_usd`: what the window's operations were billed; `total_cost_usd`: the session's so far
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from treadle.platform.audit.audit import TimelineRow
from treadle.platform.billing.prices import MICRO, TOKEN_CLASSES

OPTIM_METRICS = {"learning_rate": "learning_rate:mean", "grad_norm": "grad_norm:mean"}


@dataclass(frozen=True)
class Cursor:
    """How far a session's steps have been taken: the last step, its optim_step's seq and the
    session's cost up to it."""

    step: int = 0
    seq: int = 0
    cost_micro_usd: int = 0


@dataclass(frozen=True)
class Step:
    step: int
    cursor: Cursor  # the cursor after this step
    time_ms: int  # when its optim_step completed (ms since the epoch)
    figures: dict[str, float]


def steps(
    rows: Sequence[TimelineRow], costs: Mapping[str, int], after: Cursor
) -> tuple[list[Step], Cursor]:
    """The completed steps in `rows` (the timeline after `after.seq`, in seq order) and the
    cursor after the last; `costs`: micro-USD billed per request id. The scan stops at the
    first ordered operation still pending: its step is not complete yet."""
    found: list[Step] = []
    window: list[TimelineRow] = []
    cursor = after
    for row in rows:
        if row.kind != "operation" or row.sampler_id is not None:
            continue
        if row.status == "pending":
            break
        window.append(row)
        if row.type == "optim_step" and row.status == "completed":
            done = [r for r in window if r.status == "completed"]
            cost = sum(costs.get(str(r.request_id), 0) for r in done)
            cursor = Cursor(cursor.step + 1, row.seq, cursor.cost_micro_usd + cost)
            figures = _figures(done, row)
            figures["cost_usd"] = cost / MICRO
            figures["total_cost_usd"] = cursor.cost_micro_usd / MICRO
            completed = row.completed_at or row.time
            found.append(Step(cursor.step, cursor, int(completed.timestamp() * 1000), figures))
            window = []
    return found, cursor


def _figures(done: Sequence[TimelineRow], optim: TimelineRow) -> dict[str, float]:
    figures: dict[str, float] = {}
    losses = [r.loss for r in done if r.type == "forward_backward" and r.loss is not None]
    if losses:
        figures["loss_sum"] = sum(losses)
    for token_class in TOKEN_CLASSES:
        figures[f"{token_class}_tokens"] = sum((r.tokens or {}).get(token_class, 0) for r in done)
    for name, key in OPTIM_METRICS.items():
        value = (optim.metrics or {}).get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            figures[name] = float(value)
    return figures
