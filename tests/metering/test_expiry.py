"""Idle expiry on a platform of its own (`treadle up`, one Celery worker) whose sessions expire
after IDLE_SECONDS without a heartbeat from their client: an expired session frees its slot and
the reservation of its running operation, and the SDK's error says the session expired."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa
import tinker

import treadle
from tests.fault.conftest import Up, start_up, wait_for
from tests.metering.conftest import (
    BASE_MODEL,
    PRICES,
    Account,
    Operator,
    datum,
    hand_cost,
    input_tokens,
    wait_consumed,
)
from treadle.worker import faults

pytestmark = [pytest.mark.integration, pytest.mark.own_services]

# Below the tinker SDK's heartbeat period (10 s), so an SDK client that sends nothing expires.
IDLE_SECONDS = 5


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    env = {"TREADLE_SESSION_IDLE_SECONDS": str(IDLE_SECONDS)}
    with start_up(workers=1, env=env) as platform:
        yield platform


@pytest.fixture(scope="module")
def operator(up: Up) -> Iterator[Operator]:
    """This module's own platform's operator (instead of the served platform's)."""
    op = Operator.of(up.db, up.base_url, up.admin_key)
    yield op
    op.close()


def status(operator: Operator, model_id: str) -> str:
    with operator.db.connect() as conn:
        return str(
            conn.execute(
                sa.text("SELECT status FROM sessions WHERE id = :id"), {"id": model_id}
            ).scalar_one()
        )


def wait_expired(operator: Operator, model_id: str) -> None:
    wait_for(lambda: status(operator, model_id) == "Expired", 30, f"{model_id} to expire")


def test_an_expired_session_frees_its_slot(operator: Operator, account: Account) -> None:
    operator.set_quota(account.tenant_id, max_sessions=1)
    client = account.client  # raw HTTP: it never heartbeats
    model = client.create_model()
    refused = client.open_model(client.new_session())
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["limit"] == "max_sessions"
    wait_expired(operator, model)
    (expired,) = operator.events(model, "SessionExpired")
    assert expired["idle_seconds"] == IDLE_SECONDS
    opened = client.open_model(client.new_session())
    client.done(opened)
    assert status(operator, opened.json()["model_id"]) == "Running"


def test_the_sdk_error_on_an_expired_session_names_the_expiry(
    operator: Operator, account: Account
) -> None:
    svc = treadle.ServiceClient(base_url=operator.base_url, api_key=account.key)
    try:
        tc = svc.create_lora_training_client(BASE_MODEL, rank=4)
        wait_expired(operator, tc.model_id)
        with pytest.raises(tinker.BadRequestError) as refused:
            tc.forward_backward([datum(5)], "cross_entropy").result()
    finally:
        svc.close()
    message = str(refused.value)
    assert f"model {tc.model_id} expired" in message
    assert "without a heartbeat from its client" in message


def test_an_expired_session_releases_the_reservation_of_its_running_operation(
    up: Up, operator: Operator, account: Account
) -> None:
    client = account.client
    model = client.create_model()
    data = [datum(16)]
    pauses = redis.Redis.from_url(up.redis_url)
    try:
        faults.arm_pause(pauses, model, "forward_backward", 60)
        running = client.forward_backward(model, 1, data)
        wait_for(lambda: pauses.get(faults.paused_key(model)), 30, "the pause")
        held = hand_cost(input_tokens(data), PRICES["train"])
        assert operator.month(account.tenant_id) == (0, 0, held, input_tokens(data))
        wait_expired(operator, model)
        failed = client.result(running.json()["request_id"])
        assert "expired" in failed["error"]
        assert operator.reservations(account.tenant_id) == []
        assert operator.month(account.tenant_id) == (0, 0, 0, 0)
        faults.release(pauses, model)  # the worker finishes it: settled already, not billed
        wait_consumed(up.redis_url, model)
    finally:
        pauses.close()
    assert operator.month(account.tenant_id) == (0, 0, 0, 0)
    assert operator.session_money(model) == (0, 0)
    assert running.json()["request_id"] not in operator.usage(account.tenant_id)


def test_no_model_opens_in_an_expired_client_session(operator: Operator, account: Account):
    """A model opened in a client session that has expired would never expire itself (expiry
    looks at running client sessions only) and would hold its slot until stopped by hand."""
    client = account.client
    session_id = client.new_session()
    first = client.open_model(session_id)
    client.done(first)
    wait_expired(operator, first.json()["model_id"])
    late = client.open_model(session_id, model_seq_id=1)
    assert 400 <= late.status_code < 500, late.text
    assert "expired" in late.json()["error"]["message"]
    with operator.db.connect() as conn:
        opened = conn.execute(
            sa.text("SELECT count(*) FROM sessions WHERE client_session_id = :s"),
            {"s": session_id},
        ).scalar_one()
    assert opened == 1
