"""A worker killed or paused at any point costs nothing: the loop finishes with no error, and its
losses, samples, final weights and optimizer state equal an uninterrupted run's bit for bit."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tests.fault.conftest import Up, wait_for
from tests.fault.loop import (
    STEPS,
    Loop,
    Outcome,
    assert_same,
    assert_settled_once,
    uninterrupted,
)

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
def reference(up: Up) -> Outcome:
    return uninterrupted(up)


@pytest.fixture
def loop(up: Up, request: pytest.FixtureRequest) -> Iterator[Loop]:
    up.wait_ready(2)  # a worker killed by the previous test is back
    loop = Loop(up, name=request.node.name[:100])
    yield loop
    loop.close()


def kill_holder(up: Up, model_id: str) -> str:
    worker_id = up.holder(model_id)[0]
    os.kill(up.worker_pids()[worker_id], signal.SIGKILL)
    return str(worker_id)


def recoveries(up: Up, model_id: str) -> list[dict]:
    return up.events(model_id, "SessionRecovered")


@pytest.mark.parametrize("op_type", ["forward_backward", "optim_step"])
def test_kill_during_an_operation_is_invisible(up: Up, reference: Outcome, loop: Loop, op_type):
    loop.run(range(4))
    loop.pause_next(op_type)  # holds after its effect on the engine, before its settlement
    futures = loop.submit(4)
    loop.wait_paused()
    kill_holder(up, loop.model_id)
    loop.collect(4, futures)
    loop.run(range(5, STEPS))
    assert_same(loop.finish(), reference)
    assert_settled_once(up, loop.model_id)
    assert recoveries(up, loop.model_id), "the next holder rebuilt the session"


def test_kill_during_save_state_is_invisible(up: Up, reference: Outcome, loop: Loop) -> None:
    loop.run(range(STEPS))
    loop.pause_next("save_weights")
    out = loop.finish(strike=lambda: (loop.wait_paused(), kill_holder(up, loop.model_id)))
    assert_same(out, reference)
    assert_settled_once(up, loop.model_id)
    saved = up.events(loop.model_id, "CheckpointSaved")
    assert [e["path"] for e in saved] == [f"tinker://{loop.model_id}/weights/final"]


def test_kill_between_operations_is_invisible(up: Up, reference: Outcome, loop: Loop) -> None:
    loop.run(range(5))
    kill_holder(up, loop.model_id)
    loop.run(range(5, STEPS))
    assert_same(loop.finish(), reference)
    assert_settled_once(up, loop.model_id)
    recovered = recoveries(up, loop.model_id)
    assert recovered and recovered[-1]["from_seq"] >= 0, "recovery should start at a checkpoint"


def test_paused_holder_that_takes_its_session_back_rebuilds_it(
    up: Up, reference: Outcome, loop: Loop
) -> None:
    """Pause the holder until the other worker takes over, resume it, kill the new holder: the
    first worker gets the session back and must not reuse the adapter it still holds."""
    loop.run(range(3))
    first, epoch = up.holder(loop.model_id)
    first_pid = up.worker_pids()[first]
    os.kill(first_pid, signal.SIGSTOP)
    try:
        second = wait_for(
            lambda: up.holder(loop.model_id)[0] not in (first, None) and up.holder(loop.model_id),
            30,
            "the other worker to take the session over",
        )[0]
        loop.run(range(3, 6))  # applied by the second worker: the first one's adapter is stale
    finally:
        os.kill(first_pid, signal.SIGCONT)
    wait_for(lambda: up.live_workers() == 2, 30, "the first worker to heartbeat again")
    os.kill(up.worker_pids()[second], signal.SIGKILL)
    wait_for(lambda: up.holder(loop.model_id)[0] == first, 30, "the first worker to take it back")
    loop.run(range(6, STEPS))
    assert_same(loop.finish(), reference)
    assert_settled_once(up, loop.model_id)
    assert up.holder(loop.model_id)[1] > epoch + 1


def test_two_successive_takeovers(up: Up, reference: Outcome, loop: Loop) -> None:
    loop.run(range(2))
    first = up.holder(loop.model_id)[0]
    pids = up.worker_pids()
    os.kill(pids[first], signal.SIGSTOP)
    try:
        second = wait_for(
            lambda: up.holder(loop.model_id)[0] not in (first, None) and up.holder(loop.model_id),
            30,
            "the first takeover",
        )[0]
        loop.run(range(2, 4))
        os.kill(pids[second], signal.SIGSTOP)
        os.kill(pids[first], signal.SIGCONT)
        wait_for(lambda: up.holder(loop.model_id)[0] == first, 30, "the second takeover")
        loop.run(range(4, 6))
    finally:
        os.kill(pids[first], signal.SIGCONT)
        os.kill(pids[second], signal.SIGCONT)
    loop.run(range(6, STEPS))
    assert_same(loop.finish(), reference)
    assert_settled_once(up, loop.model_id)
    assert len(recoveries(up, loop.model_id)) >= 2
