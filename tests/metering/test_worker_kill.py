"""Metering when a worker is killed with `kill -9` in the middle of an operation (a real `treadle
up` on embedded servers, two Celery worker processes): the operation is billed once when the
next holder runs it again, replays are never billed, and the reservation the dead worker's
operation held is never left behind."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import redis

from tests.fault.conftest import Up, start_up, wait_for
from tests.metering.conftest import (
    PRICES,
    Account,
    Operator,
    datum,
    hand_bill,
    hand_cost,
    input_tokens,
)
from treadle.worker import faults

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    with start_up(workers=2) as platform:
        yield platform


@pytest.fixture(scope="module")
def operator(up: Up) -> Iterator[Operator]:
    """This module's own platform's operator (instead of the served platform's)."""
    op = Operator.of(up.db, up.base_url, up.admin_key)
    yield op
    op.close()


@pytest.fixture(autouse=True)
def both_workers(up: Up) -> None:
    up.wait_ready(2)  # a worker killed by the previous test is back


def pause_next_forward_backward(up: Up, model_id: str) -> None:
    """The session's next forward_backward holds still after its effect, before settling."""
    client = redis.Redis.from_url(up.redis_url)
    faults.arm_pause(client, model_id, "forward_backward", 60)
    client.close()


def wait_paused(up: Up, model_id: str) -> int:
    client = redis.Redis.from_url(up.redis_url)
    try:
        raw = wait_for(lambda: client.get(faults.paused_key(model_id)), 30, "the pause")
        return int(raw)  # type: ignore[call-overload]
    finally:
        client.close()


def test_a_worker_killed_mid_operation_leaves_one_usage_record_per_operation(
    up: Up, operator: Operator, account: Account
) -> None:
    client = account.client
    model = client.create_model()
    batches = [[datum(9)], [datum(12, first=3), datum(4)], [datum(6, first=8)]]
    client.done(client.forward_backward(model, 1, batches[0]))
    pause_next_forward_backward(up, model)
    struck = client.forward_backward(model, 2, batches[1])
    assert wait_paused(up, model) == 2
    os.kill(up.holder_pid(model), signal.SIGKILL)
    client.done(struck)  # run again by the next holder, after replaying seq 1
    client.done(client.forward_backward(model, 3, batches[2]))

    recovered = operator.events(model, "SessionRecovered")
    assert len(recovered) == 1, "the next holder rebuilt the session from its log"
    operator.assert_one_row_per_completed_operation(model)
    rows = operator.usage(account.tenant_id)
    assert sorted(r.train_tokens for r in rows.values()) == sorted(
        [0] + [input_tokens(batch) for batch in batches]
    )
    bill = sum(hand_bill({"train": input_tokens(batch)}, PRICES) for batch in batches)
    tokens = sum(input_tokens(batch) for batch in batches)
    assert operator.month(account.tenant_id) == (bill, tokens, 0, 0)
    assert operator.session_money(model) == (bill, 0)


def test_a_worker_killed_while_holding_a_reservation_does_not_leak_it(
    up: Up, operator: Operator, account: Account
) -> None:
    """The session is stopped before any worker can run the operation again: its reservation is
    released with it, and nothing is billed for it."""
    client = account.client
    model = client.create_model()
    data = [datum(20), datum(15, first=2)]
    pause_next_forward_backward(up, model)
    struck = client.forward_backward(model, 1, data)
    assert wait_paused(up, model) == 1
    held = hand_cost(input_tokens(data), PRICES["train"])
    assert [(r.request_id, r.micro_usd) for r in operator.reservations(account.tenant_id)] == [
        (struck.json()["request_id"], held)
    ]
    assert operator.month(account.tenant_id) == (0, 0, held, input_tokens(data))
    holder = up.holder(model)[0]
    (other,) = [pid for worker, pid in up.worker_pids().items() if worker != holder]
    os.kill(other, signal.SIGSTOP)  # no worker can take the session over before it stops
    try:
        os.kill(up.worker_pids()[holder], signal.SIGKILL)
        stopped = client.stop(model)
    finally:
        os.kill(other, signal.SIGCONT)
    assert stopped.status_code == 200, stopped.text
    failed = client.result(struck.json()["request_id"])
    assert failed["category"] == "user" and "stopped" in failed["error"]

    assert operator.reservations(account.tenant_id) == []
    assert operator.month(account.tenant_id) == (0, 0, 0, 0)
    assert operator.session_money(model) == (0, 0)
    assert struck.json()["request_id"] not in operator.usage(account.tenant_id)
