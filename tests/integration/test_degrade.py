"""The API degrades instead of crashing: with PostgreSQL or Redis down every route answers 503
with Retry-After (or its normal answer), never 500; /healthz says what is down; new sessions go
only to live workers. In process: `create_app` against the stack of tests/integration/degraded.py.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask

from tests.integration.degraded import (
    BASE_MODEL,
    KEY,
    WORKER,
    Stack,
    create_model,
    fb_proto,
    post,
)

pytestmark = pytest.mark.integration


@dataclass
class Sweep:
    """One plausible request for every route of the app, with a valid key."""

    app: Flask
    ids: dict[str, str]

    def requests(self) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
        """(endpoint, method, path, request kwargs) for every rule and method."""
        ids = self.ids
        model, session = ids["model_id"], ids["session_id"]
        bodies: dict[str, Any] = {
            "sessions.create_session": {"tags": []},
            "sessions.session_heartbeat": {"session_id": session},
            "training.create_model": {"session_id": session, "model_seq_id": 1,
                                      "base_model": BASE_MODEL, "lora_config": {"rank": 4}},
            "training.get_info": {"model_id": model},
            "training.optim_step": {"model_id": model, "seq_id": 2,
                                    "adam_params": {"learning_rate": 1e-3}},
            "checkpoints.save_weights": {"model_id": model, "seq_id": 3, "path": "ckpt"},
            "checkpoints.save_weights_for_sampler": {"model_id": model, "seq_id": 4,
                                                     "path": "s"},
            "checkpoints.load_weights": {"path": f"tinker://{model}/weights/nope",
                                         "model_id": model, "seq_id": 5},
            "checkpoints.checkpoint_ttl": {"ttl_seconds": 60},
            "checkpoints.weights_info": {"tinker_path": f"tinker://{model}/weights/nope"},
            "sampling.create_sampling_session": {"session_id": session,
                                                 "sampling_session_seq_id": 1,
                                                 "base_model": BASE_MODEL},
            "sampling.asample": {"sampling_session_id": ids["sampler"], "seq_id": 1,
                                 "prompt": {"chunks": [{"tokens": [1, 2, 3]}]}},
            "futures.retrieve_future": {"request_id": ids["completed"]},
            # a new id on every sweep: an existing one is a 409, and sweeps are compared
            "admin.create_tenant": {"id": f"degrade-{secrets.token_hex(4)}"},
            "admin.create_key": {"role": "member"},
        }  # fmt: skip
        args = {"session_id": ids["finished_session"], "model_id": ids["stopped_model"],
                "run_id": model, "checkpoint_id": "weights/nope", "sampler": ids["sampler"],
                "filename": "nope", "key_id": "key-nope", "tenant_id": "degrade-nope",
                "token": "nope", "org": "treadle", "name": "tiny-debug", "revision": "main",
                "path": "tokenizer.json", "operation_id": "nope"}  # fmt: skip
        for rule in sorted(self.app.url_map.iter_rules(), key=lambda r: r.rule):
            path = rule.rule
            for name in rule.arguments:
                path = path.replace(f"<{name}>", args[name]).replace(f"<path:{name}>", args[name])
            for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
                kwargs: dict[str, Any] = {"headers": {"X-API-Key": KEY}}
                if rule.endpoint == "training.forward_backward":
                    kwargs["data"] = fb_proto(model, 1)
                    kwargs["headers"]["Content-Type"] = "application/x-protobuf"
                elif method != "GET":
                    kwargs["json"] = bodies.get(rule.endpoint, {})
                yield rule.endpoint, method, path, kwargs

    def run(self) -> dict[tuple[str, str], tuple[int, Any]]:
        """(method, route) -> (status, response)."""
        client = self.app.test_client()
        answers = {}
        for _, method, path, kwargs in self.requests():
            response = client.open(path, method=method, **kwargs)
            answers[(method, path)] = (response.status_code, response)
        return answers


@pytest.fixture
def sweep(stack: Stack, make_app: Callable[..., Flask]) -> Sweep:
    """An app with a model whose create_model completed, a finished client session and a
    stopped model (so the finish and stop routes answer the same every time)."""
    app = make_app()
    client = app.test_client()
    session_id = post(client, "create_session", {"tags": []})["session_id"]
    created = create_model(client, session_id)
    stack.settle(created["request_id"], {"model_id": created["model_id"]})
    other = post(client, "create_session", {"tags": []})["session_id"]
    stopped = create_model(client, other)["model_id"]
    sampler = post(
        client, "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_MODEL},
    )["sampling_session_id"]  # fmt: skip
    post(client, f"treadle/sessions/{stopped}/stop", {})
    post(client, f"sessions/{other}/finish", {})
    ids = {"session_id": session_id, "model_id": created["model_id"],
           "completed": created["request_id"], "finished_session": other,
           "stopped_model": stopped, "sampler": sampler}  # fmt: skip
    return Sweep(app, ids)


def test_every_route_answers_503_with_retry_after_while_postgres_is_down(
    stack: Stack, sweep: Sweep
) -> None:
    usual = {k: status for k, (status, _) in sweep.run().items()}
    with stack.down(stack.postgres):
        answers = sweep.run()
    # A route that needs no database may still answer as usual (a key checked within the last
    # second is cached); every other answer is a 503 with Retry-After.
    wrong = {k: (status, r.get_data(as_text=True)[:200]) for k, (status, r) in answers.items()
             if not (status == 503 and r.headers.get("Retry-After"))
             and not (status == usual[k] < 500)}  # fmt: skip
    assert wrong == {}
    _, response = answers[("POST", "/api/v1/get_info")]
    assert response.get_json()["error"] == {
        "code": "unavailable",
        "message": "PostgreSQL is unreachable; retry in 5 s",
    }


def test_every_route_answers_as_usual_while_redis_is_down_except_health(
    stack: Stack, sweep: Sweep
) -> None:
    with stack.down(stack.redis):  # first: its admissions are new, so their wake-ups are tried
        answers = sweep.run()
    usual = {k: status for k, (status, _) in sweep.run().items()}  # the same, resent
    changed = {k: (usual[k], status) for k, (status, _) in answers.items() if status != usual[k]}
    assert changed == {("GET", "/healthz"): (200, 503), ("GET", "/api/v1/healthz"): (200, 503)}
    assert 500 not in usual.values()
    status, response = answers[("POST", "/api/v1/retrieve_future")]
    assert status == 200 and response.get_json() == {"model_id": sweep.ids["model_id"]}


def test_a_genuine_bug_is_still_a_500(make_app: Callable[..., Flask]) -> None:
    app = make_app()
    app.add_url_rule("/api/v1/boom", "boom", lambda: {"ratio": 1 // 0})
    response = app.test_client().get("/api/v1/boom", headers={"X-API-Key": KEY})
    assert response.status_code == 500
    assert response.get_json()["error"]["code"] == "internal"


def test_healthz_is_ok_with_a_live_worker(make_app: Callable[..., Flask]) -> None:
    response = make_app().test_client().get("/healthz")
    assert response.status_code == 200
    assert response.get_json() == {
        "status": "ok",
        "database": {"ok": True, "error": None},
        "redis": {"ok": True, "error": None},
        "workers": {"live": [WORKER], "count": 1},
    }


def test_healthz_is_unavailable_without_a_live_worker(
    stack: Stack, make_app: Callable[..., Flask]
) -> None:
    app = make_app()
    stack.set_workers()
    response = app.test_client().get("/api/v1/healthz")
    assert response.status_code == 503 and response.headers["Retry-After"]
    body = response.get_json()
    assert body["status"] == "unavailable" and body["workers"] == {"live": [], "count": 0}
    assert body["database"]["ok"] and body["redis"]["ok"]


@pytest.mark.parametrize(
    ("server", "down", "up", "error"),
    [("postgres", "database", "redis", "OperationalError"),
     ("redis", "redis", "database", "ConnectionError")],
)  # fmt: skip
def test_healthz_names_the_dependency_that_is_down(
    stack: Stack, make_app: Callable[..., Flask], server: str, down: str, up: str, error: str
) -> None:
    app = make_app()
    with stack.down(getattr(stack, server)):
        started = time.monotonic()
        response = app.test_client().get("/healthz")
        assert time.monotonic() - started < 5
    body = response.get_json()
    assert response.status_code == 503 and body["status"] == "unavailable"
    assert not body[down]["ok"] and error in body[down]["error"]
    assert body[up] == {"ok": True, "error": None}


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("create_model", {"model_seq_id": 0, "base_model": BASE_MODEL}),
        ("create_sampling_session", {"sampling_session_seq_id": 0, "base_model": BASE_MODEL}),
    ],
)
def test_a_new_session_without_a_live_worker_answers_503_and_creates_nothing(
    stack: Stack, make_app: Callable[..., Flask], route: str, body: dict[str, Any]
) -> None:
    client = make_app().test_client()
    session_id = post(client, "create_session", {"tags": []})["session_id"]
    stack.set_workers()
    response = client.post(
        f"/api/v1/{route}", json={"session_id": session_id, **body}, headers={"X-API-Key": KEY}
    )
    assert response.status_code == 503 and response.headers["Retry-After"] == "10"
    assert "no worker is alive" in response.get_json()["error"]["message"]
    with stack.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT count(*) FROM sessions WHERE client_session_id = :s"),
            {"s": session_id},
        ).scalar_one()
    assert rows == 0
