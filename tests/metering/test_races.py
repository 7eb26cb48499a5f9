"""Quotas under races, through the real API (raw HTTP, so every status code is seen as sent: the
tinker SDK retries 429s): threads released together by a barrier race for the last of a monthly
budget and for session slots; the database's locks must let exactly as many through as fit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.metering.conftest import BASE_MODEL, Account, Operator, datum, hand_cost

pytestmark = pytest.mark.integration


def race(count: int, send: Callable[[httpx.Client, int], httpx.Response], account: Account):
    """`send(client, i)` for i in range(count), each on a thread and connection of its own,
    released at once; returns the answers in order of i."""
    barrier = threading.Barrier(count)
    clients = [
        httpx.Client(base_url=account.client.http.base_url, headers={"X-API-Key": account.key},
                     timeout=60)
        for _ in range(count)
    ]  # fmt: skip

    def one(i: int) -> httpx.Response:
        barrier.wait(timeout=30)
        return send(clients[i], i)

    try:
        with ThreadPoolExecutor(count) as pool:
            return list(pool.map(one, range(count)))
    finally:
        for client in clients:
            client.close()


def fb_body(model_id: str, seq_id: int, data: list[types.Datum]) -> bytes:
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_twenty_requests_racing_for_the_last_thousand_tokens_never_overspend(
    operator: Operator, account: Account
) -> None:
    """Each request trains 100 tokens at $2 per million (200 micro-dollars), and the budget has
    exactly 1,000 tokens' worth left: 10 are admitted, 10 refused with the documented 402. Each
    request goes to a session of its own, so only the tenant's month row orders them (with a
    lock on it removed, 15-18 of them got through)."""
    operator.set_prices({"train": "2"})
    operator.assert_no_price_scheduled()
    tenant, client = account.tenant_id, account.client
    opening = [client.open_model(client.new_session()) for _ in range(20)]
    models = [client.done(answer)["model_id"] for answer in opening]
    client.done(client.forward_backward(models[0], 1, [datum(37)]))
    spent = hand_cost(37, "2")
    assert operator.month(tenant) == (spent, 37, 0, 0)
    budget = spent + hand_cost(1000, "2")
    operator.set_quota(tenant, monthly_micro_usd=budget)
    next_seq = [2] + [1] * 19  # the first model trained once already

    answers = race(
        20,
        lambda http, i: http.post(
            "/api/v1/forward_backward",
            content=fb_body(models[i], next_seq[i], [datum(100, first=i)]),
            headers={"Content-Type": "application/x-protobuf"},
        ),
        account,
    )
    admitted = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 402]
    assert (len(admitted), len(refused)) == (10, 10), [a.status_code for a in answers]
    resets_at = operator.next_month()
    for answer in refused:
        error = answer.json()["error"]
        assert set(answer.json()) == {"error"}
        assert {k: v for k, v in error.items() if k != "message"} == {
            "code": "quota_exceeded",
            "limit": "monthly_usd",
            "value": budget / 1_000_000,
            "current": budget / 1_000_000,  # settled + held never passes the budget
            "resets_at": resets_at,
        }
        assert "monthly budget" in error["message"]
    for answer in admitted:
        client.done(answer)
    assert operator.month(tenant) == (budget, 37 + 1000, 0, 0)
    assert sum(r.cost_micro_usd for r in operator.usage(tenant).values()) == budget
    assert operator.reservations(tenant) == []


def test_ten_sessions_racing_for_a_limit_of_three_open_exactly_three(
    operator: Operator, account: Account
) -> None:
    operator.set_quota(account.tenant_id, max_sessions=3)
    sessions = [account.client.new_session() for _ in range(10)]
    answers = race(
        10,
        lambda http, i: http.post(
            "/api/v1/create_model",
            json={
                "session_id": sessions[i],
                "model_seq_id": 0,
                "base_model": BASE_MODEL,
                "lora_config": {"rank": 4},
            },
        ),  # fmt: skip
        account,
    )
    opened = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert (len(opened), len(refused)) == (3, 7), [a.status_code for a in answers]
    for answer in refused:
        error = answer.json()["error"]
        assert {k: v for k, v in error.items() if k != "message"} == {
            "code": "rate_limited",
            "limit": "max_sessions",
            "value": 3,
            "current": 3,
            "resets_at": None,
        }
        assert answer.headers["Retry-After"] == "30"
    for answer in opened:
        account.client.done(answer)
    with operator.db.connect() as conn:
        live = conn.exec_driver_sql(
            "SELECT count(*) FROM sessions WHERE tenant_id = %s AND kind = 'training' "
            "AND status IN ('Created', 'Running')",
            (account.tenant_id,),
        ).scalar_one()
    assert live == 3
