"""Ordering, exactly-once and dedupe of operations, proved from the event log."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import pytest
import sqlalchemy as sa

from tests.integration.wire_client import WireClient, datum
from treadle.platform.eventlog import events

pytestmark = pytest.mark.integration


def _op_events(engine: sa.Engine, model_id: str) -> list[events.Event]:
    with engine.connect() as conn:
        return events.read_stream(conn, model_id)


def test_fifty_concurrent_operations_run_in_seq_order_exactly_once(platform, engine) -> None:
    client = WireClient(platform.base_url, platform.admin_key)
    model_id = client.create_model()
    seqs = list(range(1, 51))
    random.Random(7).shuffle(seqs)
    request_ids: dict[int, str] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def send(chunk: list[int]) -> None:
        own = WireClient(platform.base_url, platform.admin_key)
        try:
            for seq in chunk:
                time.sleep(random.random() * 0.02)
                if seq % 5 == 0:
                    r = own.optim_step(model_id, seq)
                else:
                    r = own.forward_backward(model_id, seq, [datum([5, 6, 7, 8, seq])])
                r.raise_for_status()
                with lock:
                    request_ids[seq] = r.json()["request_id"]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(seqs[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(request_ids.values())) == 50
    results = {seq: client.result(rid) for seq, rid in request_ids.items()}
    assert all(not isinstance(r, dict) or "error" not in r for r in results.values())

    stream = _op_events(engine, model_id)
    requested = Counter(e.data["seq_id"] for e in stream if e.type == "OperationRequested")
    completed = [e.data["seq_id"] for e in stream if e.type == "OperationCompleted"]
    assert all(requested[s] == 1 for s in range(0, 51)) and len(requested) == 51
    assert completed == list(range(0, 51))  # in seq order, each exactly once
    assert not [e for e in stream if e.type == "OperationFailed"]
    train = [e.data["tokens"]["train"] for e in stream if e.type == "OperationCompleted"]
    assert train[1] == 4 and all(
        e.data["duration_ms"] >= 0 for e in stream if e.type == "OperationCompleted"
    )


def test_resent_seq_returns_same_request_and_runs_once(platform, engine) -> None:
    client = WireClient(platform.base_url, platform.admin_key)
    model_id = client.create_model()
    first = client.forward_backward(model_id, 1, [datum([1, 2, 3, 4])]).json()
    again = client.forward_backward(model_id, 1, [datum([1, 2, 3, 4])]).json()
    assert first["request_id"] == again["request_id"]
    client.result(first["request_id"])
    resent_after_completion = client.forward_backward(model_id, 1, [datum([1, 2, 3, 4])]).json()
    assert resent_after_completion["request_id"] == first["request_id"]

    different = client.forward_backward(model_id, 1, [datum([9, 9, 9])])
    assert different.status_code == 400
    assert "seq_id 1" in different.json()["error"]["message"]

    stream = _op_events(engine, model_id)
    assert [e.type for e in stream if e.data.get("seq_id") == 1] == [
        "OperationRequested",
        "OperationCompleted",
    ]


def test_resent_unnamed_sampler_save_is_the_same_save_whatever_its_sampler_number(
    platform,
) -> None:
    """The tinker SDK numbers an unnamed sampler anew on each retry of its save
    (tests/compat/test_lost_answers.py); the save it repeats is still the one at its seq_id. A
    different kind of save there is another request."""
    client = WireClient(platform.base_url, platform.admin_key)
    model_id = client.create_model()
    save = {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0}
    first = client.post("save_weights_for_sampler", save).json()
    retried = client.post("save_weights_for_sampler", {**save, "sampling_session_seq_id": 1})
    assert retried.status_code == 200, retried.text
    assert retried.json()["request_id"] == first["request_id"]
    sampler = client.result(first["request_id"])["sampling_session_id"]
    assert sampler.endswith(":sample:0")  # the first request's sampler, made once

    inflight = client.post("save_weights_for_sampler", {**save, "kind": "inflight"})
    assert inflight.status_code == 400
    assert "already used by a different save_weights_for_sampler" in inflight.text


def test_out_of_order_arrival_waits_for_the_gap(platform, engine) -> None:
    client = WireClient(platform.base_url, platform.admin_key)
    model_id = client.create_model()
    second = client.optim_step(model_id, 2).json()["request_id"]
    time.sleep(1.0)
    with engine.connect() as conn:
        status = conn.execute(
            sa.text("SELECT status FROM operations WHERE request_id = :r"), {"r": second}
        ).scalar_one()
    assert status == "pending"
    first = client.forward_backward(model_id, 1, [datum([3, 4, 5])]).json()["request_id"]
    client.result(second)
    completed = [
        e.data["seq_id"] for e in _op_events(engine, model_id) if e.type == "OperationCompleted"
    ]
    assert completed == [0, 1, 2]
    assert client.result(first).metrics["loss:sum"] > 0


def test_another_tenants_session_answers_404(platform) -> None:
    admin = WireClient(platform.base_url, platform.admin_key)
    model_id = admin.create_model()
    fut = admin.optim_step(model_id, 1).json()["request_id"]
    created = admin.post("treadle/tenants", {"id": "acme"})
    assert created.status_code == 201, created.text
    other = WireClient(platform.base_url, created.json()["api_key"])

    missing = other.post("get_info", {"model_id": "sess-nope:train:0"})
    foreign = other.post("get_info", {"model_id": model_id})
    assert foreign.status_code == missing.status_code == 404
    assert other.optim_step(model_id, 2).status_code == 404
    assert other.post("retrieve_future", {"request_id": fut}).status_code == 404
    assert other.http.get(f"/api/v1/treadle/sessions/{model_id}/events").status_code == 404
    # a tenant admin (the first key of a new tenant) cannot create tenants
    assert other.post("treadle/tenants", {"id": "evil"}).status_code == 403


def test_bad_requests_get_clear_4xx(platform) -> None:
    client = WireClient(platform.base_url, platform.admin_key)
    assert (
        client.http.post("/api/v1/get_info", headers={"X-API-Key": "tml-wrong-key-xyz"}).status_code
        == 401
    )
    bad_model = client.post(
        "create_model", {"session_id": "x", "model_seq_id": 0, "base_model": "nope/nope"}
    )
    assert (
        bad_model.status_code == 400
        and "treadle/tiny-debug" in bad_model.json()["error"]["message"]
    )
    model_id = client.create_model()
    garbage = client.http.post(
        "/api/v1/forward_backward",
        content=b"\xff\xff\xff",
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert garbage.status_code == 400
    out_of_vocab = client.forward_backward(model_id, 1, [datum([1, 2, 10**6])])
    assert out_of_vocab.status_code == 400 and "datum 0" in out_of_vocab.json()["error"]["message"]
    bad_lr = client.post(
        "optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": -1}}
    )
    assert bad_lr.status_code == 400 and "learning_rate" in bad_lr.json()["error"]["message"]
    assert client.post("optim_step", ["not", "an", "object"]).status_code == 400


def test_stopping_a_session_fails_its_pending_operations(platform, engine) -> None:
    client = WireClient(platform.base_url, platform.admin_key)
    model_id = client.create_model()
    waiting = client.optim_step(model_id, 2).json()["request_id"]  # seq 1 never comes
    stop = client.http.post(f"/api/v1/treadle/sessions/{model_id}/stop")
    assert stop.status_code == 200
    failed = client.result(waiting, timeout=10)
    assert failed["category"] == "user" and "stopped" in failed["error"]
    assert client.optim_step(model_id, 1).status_code == 400  # no new work on a stopped model
    types = [e.type for e in _op_events(engine, model_id)]
    assert types[-2:] == ["SessionStopped", "OperationFailed"]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("get_info", {"model_id": "nul\x00"}),
        ("optim_step", {"model_id": "m", "seq_id": 2**70}),
        (
            "optim_step",
            {"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": float("inf")}},
        ),
        ("session_heartbeat", {"session_id": "\x00"}),
        ("retrieve_future", {"request_id": "req-\x00"}),
        ("save_weights", {"model_id": "m", "seq_id": 1, "path": "ok", "ttl_seconds": 2**62}),
    ],
)
def test_hostile_values_are_400_not_500(platform, route: str, body: dict) -> None:
    client = WireClient(platform.base_url, platform.admin_key)
    response = client.http.post(
        f"/api/v1/{route}", content=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text


def test_bad_query_parameters_are_400(platform) -> None:
    client = WireClient(platform.base_url, platform.admin_key)
    assert client.http.get("/api/v1/training_runs", params={"limit": "abc"}).status_code == 400
    assert client.http.get("/api/v1/checkpoints", params={"offset": "-1"}).status_code == 400


def test_heartbeat_answers_until_the_session_is_finished(platform) -> None:
    client = WireClient(platform.base_url, platform.admin_key)
    session_id = client.post("create_session", {}).json()["session_id"]
    beat = client.post("session_heartbeat", {"session_id": session_id, "type": "session_heartbeat"})
    assert beat.status_code == 200 and beat.json() == {"type": "session_heartbeat"}
    client.post(f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    assert client.post("session_heartbeat", {"session_id": session_id}).status_code == 410
