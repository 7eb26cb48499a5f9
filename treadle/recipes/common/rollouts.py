"""Asynchronous rollouts: a pool of workers playing groups while the trainer steps, and a
per-group staleness policy.

The trainer publishes a sampling client after each optimizer step (`RolloutPool.publish`). Workers
take work in order and play it (a recipe's `play(work, sampler)`, e.g. one group of episodes)
on the newest client; the trainer `take`s finished groups in the order they finish. Work is
handed out `batch_size` items per step: an item meant for step m may start once weights from
step m - max_steps_off_policy exist, which bounds how far the workers run ahead. A group that
finishes late (a slow sandbox, a long episode) can still reach the trainer more than
`max_steps_off_policy` steps after the weights that played it; then the policy decides:
`requeue` plays the same work again on the newest weights, `drop` discards it and plays the next
item in its place. Either way the trainer gets only groups within the limit.

Pure Python threads; nothing here knows about models or environments.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class StalePolicy(StrEnum):
    REQUEUE = "requeue"  # play the group again on the newest weights
    DROP = "drop"  # discard it; the next item takes its place


@dataclass(frozen=True)
class Work:
    index: int  # which item of the data order (the recipe maps it to a problem)
    target_step: int  # the step it was handed out for (it may start at target - max_off)
    attempt: int = 0  # 1 and more: played again after a stale finish


@dataclass(frozen=True)
class Rollout(Generic[T]):
    work: Work
    sampler_step: int  # optimizer steps the weights that played it had taken
    result: T
    seconds: float


class RolloutPool(Generic[T]):
    """`num_workers` threads playing work items on the newest published sampler; `take(step)`
    hands the trainer the next group that finished within the staleness limit of `step`.

    Items start at `start_step * batch_size` (a resumed run continues the data order) and
    `batch_size` of them are meant for each step. `requeued` and `dropped` count the stale
    groups the policy turned away.
    """

    def __init__(
        self,
        play: Callable[[Work, Any], T],
        sampler: Any,
        *,
        num_workers: int,
        batch_size: int,
        start_step: int,
        max_steps_off_policy: int,
        stale_policy: StalePolicy,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, not {num_workers}")
        self._play = play
        self._latest: tuple[Any, int] = (sampler, start_step)
        self._changed = threading.Condition()
        self._closed = False
        self._batch_size, self._max_off, self._policy = (
            batch_size,
            max_steps_off_policy,
            stale_policy,
        )
        self._next_index = start_step * batch_size
        self._pending: collections.deque[Work] = collections.deque()  # requeued and replacements
        self._finished: queue.Queue[Rollout[T] | BaseException] = queue.Queue()
        self.requeued = 0
        self.dropped = 0
        self._threads = [
            threading.Thread(target=self._work, name=f"rollout-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()

    def publish(self, sampler: Any, step: int) -> None:
        """The trainer's newest weights: a sampling client on them after `step` steps."""
        with self._changed:
            self._latest = (sampler, step)
            self._changed.notify_all()

    def latest(self) -> tuple[Any, int]:
        with self._changed:
            return self._latest

    def _next_work(self) -> Work | None:
        """The next item whose weights are recent enough, waiting for them; None once closed."""
        with self._changed:
            while not self._closed:
                published = self._latest[1]
                if self._pending and self._pending[0].target_step - self._max_off <= published:
                    return self._pending.popleft()
                if not self._pending:
                    target = self._next_index // self._batch_size
                    if target - self._max_off <= published:
                        self._next_index += 1
                        return Work(self._next_index - 1, target)
                self._changed.wait()
            return None

    def _work(self) -> None:
        try:
            while (work := self._next_work()) is not None:
                started = time.monotonic()
                client, step = self.latest()
                result = self._play(work, client)
                self._finished.put(Rollout(work, step, result, time.monotonic() - started))
        except BaseException as e:  # handed to the trainer, which raises it
            self._finished.put(e)

    def take(self, step: int) -> Rollout[T]:
        """The next finished group at most max_steps_off_policy steps older than `step`; a
        staler one is requeued or dropped (and counted) and the next one taken."""
        while True:
            rollout = self._finished.get()
            if isinstance(rollout, BaseException):
                raise rollout
            if step - rollout.sampler_step <= self._max_off:
                return rollout
            with self._changed:
                if self._policy is StalePolicy.REQUEUE:
                    self.requeued += 1
                    work = replace(rollout.work, target_step=step, attempt=rollout.work.attempt + 1)
                else:
                    self.dropped += 1
                    work = Work(self._next_index, step)
                    self._next_index += 1
                self._pending.appendleft(work)
                self._changed.notify_all()

    def close(self) -> None:
        """Stop handing out work and wait for the items being played to finish."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()
