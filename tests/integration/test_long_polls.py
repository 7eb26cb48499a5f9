"""Long-polls: one Redis subscription per API process serves every waiting request, a waiter
holds no database connection, polls the database while Redis is down, the real SDK backs off
while PostgreSQL is down, and 150 long-polls of one tenant cost another tenant nothing."""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa
import tinker
from flask import Flask
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tests.integration.degraded import (
    BASE_MODEL,
    KEY,
    Stack,
    create_model,
    fb_proto,
    post,
)
from tests.integration.wire_client import WireClient, datum
from tests.served_app import served
from treadle.api.context import Services
from treadle.platform.eventlog import notify

pytestmark = pytest.mark.integration


# --- the notice hub ---------------------------------------------------------------------------


def _in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(target()), daemon=True)
    thread.start()
    return thread, out


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def _subscribed_hub(
    stack: Stack, **options: float
) -> Iterator[tuple[redis.Redis, notify.NoticeHub]]:
    """A client of the stack's Redis and a hub on it (`options`: its intervals), subscribed."""
    client = redis.Redis.from_url(stack.redis_url)
    hub = notify.NoticeHub(client, **options).start()
    try:
        _wait(lambda: hub.is_subscribed, 5, "the hub to subscribe")
        yield client, hub
    finally:
        hub.close()
        client.close()


def test_a_notice_ends_a_long_poll_at_once(stack: Stack) -> None:
    done = threading.Event()
    with _subscribed_hub(stack, recheck_seconds=60) as (client, hub):
        thread, out = _in_thread(
            lambda: hub.wait_until("req-1", lambda: "done" if done.is_set() else None, 30)
        )
        _wait(lambda: hub.waiting == 1, 5, "the waiter to register")
        done.set()
        published = time.monotonic()
        assert notify.publish_done(client, "req-1")
        thread.join(5)
        assert out == ["done"] and time.monotonic() - published < 1.0


class _Checks:
    """A waiter's `check`: counts its calls, answers "done" once `done` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.done = threading.Event()

    def __call__(self) -> str | None:
        self.calls += 1
        return "done" if self.done.is_set() else None


def _noticed(client: redis.Redis, checks: _Checks, request_id: str) -> None:
    """Settle `request_id` (its check answers "done") and publish its notice."""
    checks.done.set()
    assert notify.publish_done(client, request_id)


def _published(client: redis.Redis, request_id: str, outcome: bytes | None) -> bytes:
    """Publish `request_id`'s notice carrying `outcome`; what went out on its channel."""
    spy = client.pubsub()
    spy.subscribe(notify.channel(request_id))
    _wait(lambda: spy.get_message(timeout=0.1) is not None, 5, "the spy to subscribe")
    assert notify.publish_done(client, request_id, outcome)
    deadline = time.monotonic() + 5
    while (message := spy.get_message(timeout=0.1)) is None:
        assert time.monotonic() < deadline, "timed out waiting for the notice to go out"
    spy.close()
    return bytes(message["data"])


def test_a_request_admitted_here_is_waited_on_without_a_first_check(stack: Stack) -> None:
    with _subscribed_hub(stack, recheck_seconds=60) as (client, hub):
        hub.expect("req-3", "tenant-a")
        ours, theirs = _Checks(), _Checks()
        waits = [
            _in_thread(lambda: hub.wait_until("req-3", ours, 30, tenant_id="tenant-a")),
            # another tenant's poll of the same id reads the database first (its 404)
            _in_thread(lambda: hub.wait_until("req-3", theirs, 30, tenant_id="tenant-b")),
        ]
        _wait(lambda: hub.waiting == 2, 5, "the waiters to register")
        _wait(lambda: theirs.calls == 1, 5, "the other tenant's first check")
        assert ours.calls == 0
        ours.done.set()
        _noticed(client, theirs, "req-3")
        for thread, _ in waits:
            thread.join(5)
        assert [out for _, out in waits] == [["done"], ["done"]]
        assert (ours.calls, theirs.calls) == (1, 2)
        # Noticed: a later poll reads the database at once.
        again = _Checks()
        again.done.set()
        assert hub.wait_until("req-3", again, 30, tenant_id="tenant-a") == "done"
        assert again.calls == 1


def test_a_notice_before_the_poll_leaves_the_first_check_in(stack: Stack) -> None:
    with _subscribed_hub(stack, recheck_seconds=60) as (client, hub):
        hub.expect("req-4", "tenant-a")
        checks = _Checks()
        checks.done.set()
        _published(client, "req-4", None)  # settled before its first poll
        time.sleep(0.2)  # and the hub to take it
        started = time.monotonic()
        assert hub.wait_until("req-4", checks, 30, tenant_id="tenant-a") == "done"
        assert checks.calls == 1 and time.monotonic() - started < 1.0


def test_a_lost_subscription_forgets_what_was_expected(stack: Stack) -> None:
    with _subscribed_hub(stack, recheck_seconds=60, poll_seconds=0.5) as (_, hub):
        hub.expect("req-5", "tenant-a")
        checks = _Checks()
        checks.done.set()  # settled while Redis was down: its notice never went out
        with stack.down(stack.redis):
            _wait(lambda: not hub.is_subscribed, 5, "the hub to notice Redis is down")
        _wait(lambda: hub.is_subscribed, 10, "the hub to subscribe again after Redis restarted")
        started = time.monotonic()
        assert hub.wait_until("req-5", checks, 30, tenant_id="tenant-a") == "done"
        assert checks.calls == 1 and time.monotonic() - started < 1.0


def test_a_notice_carrying_the_outcome_answers_its_waiter_without_a_check(stack: Stack) -> None:
    with _subscribed_hub(stack, recheck_seconds=60) as (client, hub):
        hub.expect("req-6", "tenant-a")
        checks = _Checks()
        thread, out = _in_thread(
            lambda: hub.wait_until("req-6", checks, 30, tenant_id="tenant-a", from_outcome=bytes)
        )
        _wait(lambda: hub.waiting == 1, 5, "the waiter to register")
        assert notify.publish_done(client, "req-6", b'{"loss": 0.5}')
        thread.join(5)
        assert out == [b'{"loss": 0.5}'] and checks.calls == 0
        # Taken: a later poll reads the database.
        checks.done.set()
        assert hub.wait_until("req-6", checks, 30, tenant_id="tenant-a", from_outcome=bytes)
        assert checks.calls == 1


def test_an_outcome_noticed_before_the_poll_is_held_for_its_tenant_only(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _subscribed_hub(stack, recheck_seconds=60) as (client, hub):
        for request_id in ("req-7", "req-8"):
            hub.expect(request_id, "tenant-a")
            _published(client, request_id, request_id.encode())

        def not_theirs() -> None:
            raise LookupError("req-7 not found")  # as the database answers another tenant

        with pytest.raises(LookupError):
            hub.wait_until("req-7", not_theirs, 30, tenant_id="tenant-b", from_outcome=bytes)
        checks = _Checks()
        checks.done.set()
        assert hub.wait_until("req-7", checks, 30, tenant_id="tenant-a", from_outcome=bytes)
        assert checks.calls == 0  # held since the notice: no check
        # Outcomes past MAX_HELD_BYTES drop the oldest: its waiter reads the database.
        _wait(lambda: hub.held_bytes == 5, 5, "the hub to hold req-8's outcome")
        monkeypatch.setattr(notify, "MAX_HELD_BYTES", 8)
        hub.expect("req-9", "tenant-a")
        _published(client, "req-9", b"req-9!")  # 5 + 6 bytes held: req-8 goes
        _wait(lambda: hub.held_bytes == 6, 5, "the hub to hold req-9's outcome")
        assert hub.wait_until("req-8", checks, 30, tenant_id="tenant-a", from_outcome=bytes)
        assert checks.calls == 1
        assert hub.wait_until("req-9", _Checks(), 30, tenant_id="tenant-a", from_outcome=bytes)


def test_an_outcome_past_the_size_limit_goes_as_a_bare_notice(stack: Stack) -> None:
    with _subscribed_hub(stack, recheck_seconds=60) as (client, hub):
        hub.expect("req-10", "tenant-a")
        large = b"x" * (notify.MAX_OUTCOME_BYTES + 1)
        assert _published(client, "req-10", large) == notify.BARE
        checks = _Checks()
        checks.done.set()
        assert hub.wait_until("req-10", checks, 30, tenant_id="tenant-a", from_outcome=bytes)
        assert checks.calls == 1
        largest = b"x" * notify.MAX_OUTCOME_BYTES
        assert _published(client, "req-11", largest) == largest


def test_a_long_poll_polls_the_database_while_redis_is_down(stack: Stack) -> None:
    client = redis.Redis.from_url(stack.redis_url)
    hub = notify.NoticeHub(client, recheck_seconds=60, poll_seconds=0.5).start()
    done = threading.Event()
    try:
        with stack.down(stack.redis):
            _wait(lambda: not hub.is_subscribed, 5, "the hub to notice Redis is down")
            thread, out = _in_thread(
                lambda: hub.wait_until("req-2", lambda: "done" if done.is_set() else None, 30)
            )
            _wait(lambda: hub.waiting == 1, 5, "the waiter to register")
            done.set()
            assert not notify.publish_done(client, "req-2")
            thread.join(3)
            assert out == ["done"]
        _wait(lambda: hub.is_subscribed, 10, "the hub to subscribe again after Redis restarted")
    finally:
        hub.close()
        client.close()


def _a_pending_operation(make_app: Callable[..., Flask]) -> tuple[Flask, Services, str, str]:
    """An app (30 s long-polls) with its hub subscribed, a model of it and the id of an operation
    admitted through it that no worker runs (its seq_id 5 waits for 0-4)."""
    app = make_app(long_poll_seconds=30.0)
    svc: Services = app.extensions["treadle"]
    client = app.test_client()
    session_id = post(client, "create_session", {"tags": []})["session_id"]
    model_id = create_model(client, session_id)["model_id"]
    _wait(lambda: svc.notices.is_subscribed, 5, "the hub to subscribe")
    pending = post(client, "optim_step", {"model_id": model_id, "seq_id": 5})["request_id"]
    return app, svc, model_id, pending


def test_waiting_long_polls_share_one_subscription_and_hold_no_database_connection(
    stack: Stack, make_app: Callable[..., Flask]
) -> None:
    app, svc, model_id, pending = _a_pending_operation(make_app)
    client = app.test_client()
    polls = [
        _in_thread(lambda: post(app.test_client(), "retrieve_future", {"request_id": pending}))
        for _ in range(30)
    ]
    _wait(lambda: svc.notices.waiting == 30, 10, "30 long-polls to wait")
    time.sleep(0.3)  # past each waiter's check right after it registered
    held = []
    for _ in range(5):
        held.append(svc.db.pool.checkedout())  # type: ignore[attr-defined]
        time.sleep(0.1)
    subscriptions = [c for c in svc.redis.client_list() if int(c.get("psub", 0)) > 0]
    post(client, f"treadle/sessions/{model_id}/stop", {})  # fails it: one notice ends all 30
    stopped = time.monotonic()
    for thread, _ in polls:
        thread.join(10)
    assert time.monotonic() - stopped < 1.5
    assert min(held) == 0 and max(held) < 30, held  # a waiter holds one only while it checks
    assert len(subscriptions) == 1, subscriptions
    failed = {"error": f"model {model_id} was stopped", "category": "user"}
    assert [out for _, out in polls] == [[failed]] * 30


def test_the_first_poll_of_a_request_admitted_here_reads_the_database_only_after_its_notice(
    stack: Stack, make_app: Callable[..., Flask]
) -> None:
    app, svc, model_id, pending = _a_pending_operation(make_app)
    client = app.test_client()
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    sa.event.listen(svc.db, "before_cursor_execute", count)
    try:
        thread, out = _in_thread(
            lambda: post(app.test_client(), "retrieve_future", {"request_id": pending})
        )
        _wait(lambda: svc.notices.waiting == 1, 5, "the long-poll to wait")
        time.sleep(0.3)
        assert statements == []  # admitted here, not noticed yet: pending, nothing to read
    finally:
        sa.event.remove(svc.db, "before_cursor_execute", count)
    post(client, f"treadle/sessions/{model_id}/stop", {})  # fails it, and its notice goes out
    thread.join(10)
    assert out == [{"error": f"model {model_id} was stopped", "category": "user"}]


# Floats whose JSON the database keeps as they are (read back equal), and two it does not:
# -0.0 (read back 0.0) and 1e16 (read back an int), which go as a bare notice.
KEPT = [0.1, 1e-07, -3.0000000000000004, 2.5e-310, 123456789.12345679, 7, -0.05]
NOT_KEPT = ({"loss": -0.0}, {"loss": 1e16})


def test_a_poll_answered_from_its_notice_answers_what_the_database_holds(
    stack: Stack, make_app: Callable[..., Flask]
) -> None:
    """retrieve_future of a request admitted here answers from the outcome its notice carried,
    reading nothing, with the same bytes as a later poll that reads the database; an outcome
    the database would not read back the same goes as a bare notice."""
    app = make_app(long_poll_seconds=30.0)
    svc: Services = app.extensions["treadle"]
    client = app.test_client()
    session_id = post(client, "create_session", {"tags": []})["session_id"]
    created = create_model(client, session_id)
    stack.settle(created["request_id"], {"model_id": created["model_id"]})
    model_id = created["model_id"]
    _wait(lambda: svc.notices.is_subscribed, 5, "the hub to subscribe")
    proto = {"X-API-Key": KEY, "Content-Type": "application/x-protobuf"}
    outputs = [{"logprobs": {"dtype": "float32", "shape": [len(KEPT)], "data": KEPT}}]
    fb = client.post("/api/v1/forward_backward", data=fb_proto(model_id, 1), headers=proto)
    fb_result = {"loss_fn_outputs": outputs, "metrics": {"loss:sum": 0.1, "b": 1.5, "a": -2.25}}
    cases = [(fb.get_json()["request_id"], fb_result, True)]
    for seq_id, result in enumerate([{"metrics": {str(v): v for v in KEPT}}, *NOT_KEPT], 2):
        step = post(client, "optim_step", {"model_id": model_id, "seq_id": seq_id})
        cases.append((step["request_id"], result, False))
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    for request_id, result, is_proto in cases:
        body = {"request_id": request_id}
        poll = functools.partial(
            app.test_client().post, "/api/v1/retrieve_future", json=body, headers={"X-API-Key": KEY}
        )
        thread, out = _in_thread(poll)
        _wait(lambda: svc.notices.waiting == 1, 5, "the long-poll to wait")
        statements.clear()
        sa.event.listen(svc.db, "before_cursor_execute", count)
        try:
            stack.settle(request_id, result, carry=True)
            thread.join(10)
        finally:
            sa.event.remove(svc.db, "before_cursor_execute", count)
        kept = result not in NOT_KEPT
        assert (statements == []) == kept, (result, statements)
        again = client.post("/api/v1/retrieve_future", json=body, headers={"X-API-Key": KEY})
        assert out[0].status_code == again.status_code == 200
        if is_proto:  # map entries may come in another order: compare the messages
            first, second = pb.ForwardBackwardOutput(), pb.ForwardBackwardOutput()
            first.ParseFromString(out[0].get_data())
            second.ParseFromString(again.get_data())
            assert first == second
        else:  # the same keys (their order aside), values and types (json.dumps tells)
            first, second = (json.dumps(r.get_json(), sort_keys=True) for r in (out[0], again))
            assert first == second, result


# --- the real SDK -----------------------------------------------------------------------------


def test_a_polled_sdk_future_backs_off_while_postgres_is_down(
    stack: Stack, make_app: Callable[..., Flask]
) -> None:
    outage = 4.0
    app = make_app(long_poll_seconds=2.0)  # a held 503 lasts min(Retry-After, a long-poll)
    with served(app) as (base_url, counts):
        svc = tinker.ServiceClient(base_url=base_url, api_key=KEY)
        future = svc.create_lora_training_client(BASE_MODEL, rank=4)
        _wait(lambda: any(p.endswith("retrieve_future") for p, _ in counts), 30, "a poll")
        with stack.down(stack.postgres):
            counts.clear()
            time.sleep(outage)
            during = dict(counts)
        with stack.engine.connect() as conn:
            request_id, model_id = conn.execute(
                sa.text(
                    "SELECT request_id, session_id FROM operations WHERE type = 'create_model' "
                    "AND status = 'pending' ORDER BY request_position DESC LIMIT 1"
                )
            ).one()
        stack.settle(request_id, {"model_id": model_id})
        training_client = future.result(timeout=30)
        assert training_client.model_id == model_id
        svc.close("success").result(timeout=30)
    polls = sum(n for (path, _), n in during.items() if path.endswith("retrieve_future"))
    assert {status for _, status in during} <= {503}, during
    assert 1 <= polls <= outage / 2 + 2, during


# --- many long-polls on a served platform ----------------------------------------------------


def test_150_long_polls_of_one_tenant_cause_no_error_for_another(platform) -> None:
    admin = WireClient(platform.base_url, platform.admin_key)
    model_id = admin.create_model()
    pending = [  # seqs 1-4 never arrive: these stay pending until the gap timeout
        admin.forward_backward(model_id, seq, [datum([1, 2, 3, 4])]).json()["request_id"]
        for seq in range(5, 10)
    ]
    tenant = admin.post("treadle/tenants", {"id": f"degrade-{secrets.token_hex(3)}"})
    assert tenant.status_code == 201, tenant.text
    key = tenant.json()["api_key"]
    stop = threading.Event()
    polled: collections.Counter[int] = collections.Counter()
    http = httpx.Client(
        base_url=platform.base_url, headers={"X-API-Key": platform.admin_key}, timeout=60,
        limits=httpx.Limits(max_connections=200, max_keepalive_connections=200),
    )  # fmt: skip

    def poll(request_id: str) -> None:
        while not stop.is_set():
            polled[
                http.post("/api/v1/retrieve_future", json={"request_id": request_id}).status_code
            ] += 1

    pollers = [threading.Thread(target=poll, args=(pending[i % 5],)) for i in range(150)]
    for thread in pollers:
        thread.start()
    other = WireClient(platform.base_url, key)
    seen: list[int] = []  # every status the other tenant's raw client got
    other.http.event_hooks["response"] = [lambda r: seen.append(r.status_code)]
    try:
        time.sleep(1.0)  # every poller is waiting
        own = other.create_model()
        fb = other.forward_backward(own, 1, [datum([5, 6, 7, 8, 9])]).json()["request_id"]
        assert other.result(fb).metrics["loss:sum"] > 0
        other.post(f"treadle/sessions/{own}/stop", {})
        svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
        tc = svc.create_lora_training_client(BASE_MODEL, rank=4).result()
        for _ in range(2):
            loss = tc.forward_backward([datum([5, 6, 7, 8, 9])], "cross_entropy")
            step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            assert loss.result().metrics["loss:sum"] > 0
            step.result()
        svc.close("success").result()
    finally:
        stop.set()
        # Stopping the model fails its pending operations: every waiting poll returns at once.
        admin.post(f"treadle/sessions/{model_id}/stop", {}).raise_for_status()
        for thread in pollers:
            thread.join(30)
        http.close()
    # 408: a long-poll that ended before the result (routes_futures.STILL_RUNNING), not an error
    assert seen and set(seen) <= {200, 408}, seen
    assert set(polled) <= {200, 408}, polled
