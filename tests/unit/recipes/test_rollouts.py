"""The rollout pool (treadle/recipes/common/rollouts.py): workers play ahead within the staleness
limit, and a group that finishes too late is requeued or dropped, never trained on."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from treadle.recipes.common.rollouts import RolloutPool, StalePolicy, Work

WAIT_S = 30  # a bound for a broken pool to fail instead of hanging; not a timing assertion


def wait_until(condition: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "the pool never got there"
        time.sleep(0.01)


def trained(pool: RolloutPool[str], steps: int) -> list[tuple[int, Work, int]]:
    """A trainer of one group per step: (step, the group's work, the weights that played it)."""
    seen = []
    for step in range(steps):
        rollout = pool.take(step)
        seen.append((step, rollout.work, rollout.sampler_step))
        pool.publish(f"sampler-{step + 1}", step + 1)
    return seen


def slow_first_group(pool_ref: list[RolloutPool[str]]) -> Any:
    """Item 0 finishes only once weights from step 2 exist (two steps after the weights it
    started on); items after 2 wait until weights of their own step exist, so item 0 is the
    first group to reach step 2's trainer, and what it is replaced with the second."""

    def play(work: Work, sampler: Any) -> str:
        wait_until(lambda: pool_ref)  # the workers start inside the constructor
        pool = pool_ref[0]
        if work.index == 0 and work.attempt == 0:
            wait_until(lambda: pool.latest()[1] >= 2)
        elif work.index > 2:
            wait_until(lambda: pool.latest()[1] >= work.target_step)
        return f"{work.index}:{sampler}"

    return play


@pytest.mark.parametrize("policy", list(StalePolicy))
def test_a_group_older_than_the_limit_is_requeued_or_dropped(policy: StalePolicy) -> None:
    ref: list[RolloutPool[str]] = []
    pool = RolloutPool(slow_first_group(ref), "sampler-0", num_workers=2, batch_size=1,
                       start_step=0, max_steps_off_policy=1, stale_policy=policy)  # fmt: skip
    ref.append(pool)
    try:
        seen = trained(pool, 4)
    finally:
        pool.close()
    assert all(step - sampler_step <= 1 for step, _, sampler_step in seen)
    # Steps 0 and 1 trained items 1 and 2 while item 0 was still playing on weights 0.
    assert [(work.index, sampler) for _, work, sampler in seen[:2]] == [(1, 0), (2, 1)]
    step2 = seen[2][1]
    if policy is StalePolicy.REQUEUE:
        assert (pool.requeued, pool.dropped) == (1, 0)
        # Item 0 was played again on the newest weights and trained at step 2.
        assert (step2.index, step2.attempt, seen[2][2]) == (0, 1, 2)
    else:
        assert (pool.requeued, pool.dropped) == (0, 1)
        # Item 4 took its place at step 2 (item 3 is meant for step 3).
        assert (step2.index, seen[2][2]) == (4, 2)
        assert 0 not in {work.index for _, work, _ in seen}


def test_workers_never_start_work_beyond_the_limit() -> None:
    """With the trainer not stepping, workers play only the items meant for steps up to
    max_steps_off_policy ahead of the published weights."""
    started: list[int] = []
    lock = threading.Lock()

    def play(work: Work, sampler: Any) -> str:
        with lock:
            started.append(work.index)
        return str(work.index)

    pool = RolloutPool(play, "s0", num_workers=3, batch_size=2, start_step=5,
                       max_steps_off_policy=1, stale_policy=StalePolicy.REQUEUE)  # fmt: skip
    try:
        wait_until(lambda: len(started) >= 4)
        time.sleep(0.2)  # room for a wrong extra start to show
        assert sorted(started) == [10, 11, 12, 13]  # steps 5 and 6, from the resumed step on
        rollout = pool.take(5)
        assert rollout.sampler_step == 5 and rollout.work.target_step in (5, 6)
    finally:
        pool.close()


def test_an_error_in_a_worker_reaches_the_trainer() -> None:
    def play(work: Work, sampler: Any) -> str:
        raise RuntimeError("the sandbox is on fire")

    pool = RolloutPool(play, "s0", num_workers=1, batch_size=1, start_step=0,
                       max_steps_off_policy=0, stale_policy=StalePolicy.DROP)  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match="on fire"):
            pool.take(0)
    finally:
        pool.close()
