"""How many CPU threads one engine call runs on: one for a small call, all of them otherwise.

A call's work is counted in multiply-adds (tokens x the model's parameters for a forward pass,
a few per parameter for an optimizer step). Below `SMALL_CALL_WORK` a call runs on one thread:
its matrix products are too small to split, and every parallel region would wake the other
OpenMP threads and wait for them (tens of microseconds each on a shared machine, a few hundred
regions a forward). With one thread there are no parallel regions at all, so no thread spins
or wakes. The engine runs one call at a time, so changing the process's thread count for the
call is safe. Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["SMALL_CALL_WORK", "threads_for"]

# About a millisecond of one core's multiply-adds (docs/benchmarks.md, "Round trip").
SMALL_CALL_WORK = 50_000_000


@contextlib.contextmanager
def threads_for(work: int, device: torch.device) -> Iterator[None]:
    """Run the block on one CPU thread if `work` is below SMALL_CALL_WORK (CPU devices only; a
    GPU call's host side is one thread anyway), else on the process's threads as they are."""
    before = torch.get_num_threads()
    if device.type != "cpu" or work >= SMALL_CALL_WORK or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
