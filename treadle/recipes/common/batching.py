"""Deterministic data order: the batch of step n depends only on (items, size, seed, n), so a
resumed run and a run through another client see the same data at every step."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def batch_at(items: Sequence[T], size: int, seed: int, step: int) -> list[T]:
    """Step `step`'s batch: epochs are shuffles of `items` (one per epoch, from the seed), read
    in order `size` at a time; a batch may span the end of one epoch and the start of the next."""
    if not items:
        raise ValueError("no items to batch")
    start = step * size
    return [
        _epoch(items, seed, i // len(items))[i % len(items)] for i in range(start, start + size)
    ]


def _epoch(items: Sequence[T], seed: int, epoch: int) -> list[T]:
    order = list(items)
    random.Random(f"{seed}:epoch:{epoch}").shuffle(order)
    return order


def step_seed(seed: int, step: int, *parts: int) -> int:
    """A 31-bit seed for one request of one step (sampling seeds the platform accepts)."""
    return random.Random(":".join(str(p) for p in (seed, step, *parts))).getrandbits(31)
