"""PostgreSQL or Redis killed mid-loop: `treadle up` restarts it and the loop finishes with the
weights of an uninterrupted run; no operation is applied twice."""

from __future__ import annotations

import os
import signal

import pytest
import redis
import sqlalchemy as sa

from tests.fault.conftest import Up, wait_for
from tests.fault.loop import (
    STEPS,
    Loop,
    Outcome,
    assert_same,
    assert_settled_once,
    uninterrupted,
)
from treadle.worker import faults

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
def reference(up: Up) -> Outcome:
    return uninterrupted(up)


def _database_answers(up: Up) -> bool:
    with up.db.connect() as conn:
        return conn.execute(sa.text("SELECT 1")).scalar_one() == 1


def test_postgres_killed_while_an_operation_settles_applies_it_once(
    up: Up, reference: Outcome
) -> None:
    up.wait_ready(2)
    loop = Loop(up, name="postgres-killed")
    loop.run(range(4))
    loop.pause_next("forward_backward")
    futures = loop.submit(4)
    seq_id = loop.wait_paused()
    state = up.state()
    postgres = state["postgres"]["pid"]
    client = redis.Redis.from_url(up.redis_url)
    # Hold `treadle up` (its supervisor) still, so PostgreSQL stays down until the paused
    # operation has tried to settle and failed.
    os.kill(state["pid"], signal.SIGSTOP)
    try:
        os.kill(postgres, signal.SIGKILL)
        faults.release(client, loop.model_id)
        wait_for(
            lambda: client.get(faults.settle_failed_key(loop.model_id)) == str(seq_id).encode(),
            30,
            "the settlement to fail",
        )
    finally:
        os.kill(state["pid"], signal.SIGCONT)
        client.close()
    wait_for(lambda: up.state()["postgres"]["pid"] != postgres, 60, "PostgreSQL to restart")
    wait_for(lambda: _database_answers(up), 60, "PostgreSQL to answer")
    loop.collect(4, futures)
    loop.run(range(5, STEPS))
    assert_same(loop.finish(), reference)
    assert_settled_once(up, loop.model_id)
    loop.close()
    # The settlement failed, so the adapter that held its effect was rebuilt from the log
    # (up to the seq before it) instead of running it again on top of its own gradients.
    rebuilt = [e["to_seq"] for e in up.events(loop.model_id, "SessionRecovered")]
    assert seq_id - 1 in rebuilt, rebuilt


def test_redis_killed_between_operations_is_restarted_and_the_loop_finishes(
    up: Up, reference: Outcome
) -> None:
    up.wait_ready(2)
    loop = Loop(up, name="redis-killed")
    loop.run(range(3))
    pid = up.state()["redis"]["pid"]
    os.kill(pid, signal.SIGKILL)
    loop.run(range(3, STEPS))
    assert up.state()["redis"]["pid"] != pid
    assert_same(loop.finish(), reference)
    assert_settled_once(up, loop.model_id)
    loop.close()
