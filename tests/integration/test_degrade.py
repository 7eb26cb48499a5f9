"""The API degrades instead of crashing: with PostgreSQL or Redis down every route answers 503
with Retry-After (or its normal answer), never 500; /healthz says what is down; new sessions go
only to live workers; long-polls share one Redis subscription per process.

The in-process tests run `create_app` against their own embedded PostgreSQL and Redis, which they
stop and start; a worker is a heartbeat row that this module settles operations for by hand.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa
import tinker
from flask import Flask
from flask.testing import FlaskClient
from tinker import types
from werkzeug.serving import make_server

from tests.integration.wire_client import WireClient, datum
from treadle.api.app import Services
from treadle.api.app import create_app as build_app
from treadle.platform import db, leases, notify, operations
from treadle.platform import sessions as sessions_core
from treadle.platform.config import PlatformConfig
from treadle.platform.embedded import EmbeddedPostgres, EmbeddedRedis

pytestmark = pytest.mark.integration

KEY = "tml-degrade-" + secrets.token_hex(8)
WORKER = "worker-degrade"
BASE_MODEL = "treadle/tiny-debug"


@dataclass
class Stack:
    """This module's own PostgreSQL and Redis, which its tests stop and start."""

    root: Path
    postgres: EmbeddedPostgres
    redis: EmbeddedRedis
    database_url: str
    redis_url: str
    engine: sa.Engine

    @contextlib.contextmanager
    def down(self, server: EmbeddedPostgres | EmbeddedRedis) -> Iterator[None]:
        """Stop `server` for the block; it comes back on the same URL."""
        server.stop()
        try:
            yield
        finally:
            server.start()

    def set_workers(self, *worker_ids: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM workers"))
            for worker_id in worker_ids:
                leases.heartbeat_worker(conn, worker_id, {})

    def settle(self, request_id: str, result: dict[str, Any]) -> None:
        """Complete an operation as the worker holding its session would."""
        with self.engine.begin() as conn:
            op = operations.get_operation(conn, None, request_id)
            session = sessions_core.get_session(conn, None, op.session_id)
            assert session.worker_id == WORKER, session
            operations.settle(
                conn, op, worker_id=WORKER, lease_epoch=session.lease_epoch,
                result=result, error=None, usage={},
            )  # fmt: skip
        with redis.Redis.from_url(self.redis_url) as client:
            notify.publish_done(client, request_id)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    root = Path(tempfile.mkdtemp(prefix="treadle-degrade-"))
    postgres, redis_server = EmbeddedPostgres(root / "postgres"), EmbeddedRedis(root / "redis")
    try:
        database_url = postgres.start()
        db.migrate(database_url)
        redis_url = redis_server.start()
        engine = db.connect(database_url, pool_size=2)
        yield Stack(root, postgres, redis_server, database_url, redis_url, engine)
        engine.dispose()
    finally:
        redis_server.stop()
        postgres.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_app(stack: Stack) -> Iterator[Callable[..., Flask]]:
    """Build apps on the stack (one live worker unless a test says otherwise); closed after."""
    built: list[Services] = []

    def make(**overrides: Any) -> Flask:
        config = PlatformConfig(
            database_url=stack.database_url, redis_url=stack.redis_url,
            data_dir=stack.root / "data", admin_key=KEY,
            long_poll_seconds=1.0, lease_ttl_seconds=60.0,
        )  # fmt: skip
        app = build_app(dataclasses.replace(config, **overrides))
        built.append(app.extensions["treadle"])
        return app

    stack.set_workers(WORKER)
    yield make
    for svc in built:
        svc.close()


def _post(client: FlaskClient, path: str, body: dict[str, Any]) -> Any:
    response = client.post(f"/api/v1/{path}", json=body, headers={"X-API-Key": KEY})
    assert response.status_code == 200, response.get_data(as_text=True)
    return response.get_json()


def _create_model(client: FlaskClient, session_id: str, model_seq_id: int = 0) -> dict[str, Any]:
    body = {"session_id": session_id, "model_seq_id": model_seq_id, "base_model": BASE_MODEL,
            "lora_config": {"rank": 4}}  # fmt: skip
    return _post(client, "create_model", body)  # type: ignore[no-any-return]


def _fb_proto(model_id: str, seq_id: int) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum([1, 2, 3, 4])], loss_fn="cross_entropy"
        ),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


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
            "treadle.create_tenant": {"id": "degrade-tenant"},
        }  # fmt: skip
        args = {"session_id": ids["finished_session"], "model_id": ids["stopped_model"],
                "run_id": model, "checkpoint_id": "weights/nope", "sampler": ids["sampler"],
                "filename": "nope"}  # fmt: skip
        for rule in sorted(self.app.url_map.iter_rules(), key=lambda r: r.rule):
            path = rule.rule
            for name in rule.arguments:
                path = path.replace(f"<{name}>", args[name]).replace(f"<path:{name}>", args[name])
            for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
                kwargs: dict[str, Any] = {"headers": {"X-API-Key": KEY}}
                if rule.endpoint == "training.forward_backward":
                    kwargs["data"] = _fb_proto(model, 1)
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
    session_id = _post(client, "create_session", {"tags": []})["session_id"]
    created = _create_model(client, session_id)
    stack.settle(created["request_id"], {"model_id": created["model_id"]})
    other = _post(client, "create_session", {"tags": []})["session_id"]
    stopped = _create_model(client, other)["model_id"]
    sampler = _post(
        client, "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_MODEL},
    )["sampling_session_id"]  # fmt: skip
    _post(client, f"treadle/sessions/{stopped}/stop", {})
    _post(client, f"sessions/{other}/finish", {})
    ids = {"session_id": session_id, "model_id": created["model_id"],
           "completed": created["request_id"], "finished_session": other,
           "stopped_model": stopped, "sampler": sampler}  # fmt: skip
    return Sweep(app, ids)


def test_every_route_answers_503_with_retry_after_while_postgres_is_down(
    stack: Stack, sweep: Sweep
) -> None:
    with stack.down(stack.postgres):
        answers = sweep.run()
    wrong = {k: (status, r.get_data(as_text=True)[:200]) for k, (status, r) in answers.items()
             if status != 503 or not r.headers.get("Retry-After")}  # fmt: skip
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
    session_id = _post(client, "create_session", {"tags": []})["session_id"]
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


def test_a_notice_ends_a_long_poll_at_once(stack: Stack) -> None:
    client = redis.Redis.from_url(stack.redis_url)
    hub = notify.NoticeHub(client, recheck_seconds=60).start()
    done = threading.Event()
    try:
        _wait(lambda: hub.is_subscribed, 5, "the hub to subscribe")
        thread, out = _in_thread(
            lambda: hub.wait_until("req-1", lambda: "done" if done.is_set() else None, 30)
        )
        _wait(lambda: hub.waiting == 1, 5, "the waiter to register")
        done.set()
        published = time.monotonic()
        assert notify.publish_done(client, "req-1")
        thread.join(5)
        assert out == ["done"] and time.monotonic() - published < 1.0
    finally:
        hub.close()
        client.close()


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


def test_waiting_long_polls_share_one_subscription_and_hold_no_database_connection(
    stack: Stack, make_app: Callable[..., Flask]
) -> None:
    app = make_app(long_poll_seconds=30.0)
    svc: Services = app.extensions["treadle"]
    client = app.test_client()
    session_id = _post(client, "create_session", {"tags": []})["session_id"]
    model_id = _create_model(client, session_id)["model_id"]
    pending = _post(client, "optim_step", {"model_id": model_id, "seq_id": 5})["request_id"]
    _wait(lambda: svc.notices.is_subscribed, 5, "the hub to subscribe")
    polls = [
        _in_thread(lambda: _post(app.test_client(), "retrieve_future", {"request_id": pending}))
        for _ in range(30)
    ]
    _wait(lambda: svc.notices.waiting == 30, 10, "30 long-polls to wait")
    time.sleep(0.3)  # past each waiter's check right after it registered
    held = []
    for _ in range(5):
        held.append(svc.db.pool.checkedout())  # type: ignore[attr-defined]
        time.sleep(0.1)
    subscriptions = [c for c in svc.redis.client_list() if int(c.get("psub", 0)) > 0]
    _post(client, f"treadle/sessions/{model_id}/stop", {})  # fails it: one notice ends all 30
    stopped = time.monotonic()
    for thread, _ in polls:
        thread.join(10)
    assert time.monotonic() - stopped < 1.5
    assert min(held) == 0 and max(held) < 30, held  # a waiter holds one only while it checks
    assert len(subscriptions) == 1, subscriptions
    failed = {"error": f"model {model_id} was stopped", "category": "user"}
    assert [out for _, out in polls] == [[failed]] * 30


# --- the real SDK -----------------------------------------------------------------------------


@contextlib.contextmanager
def _served(app: Flask) -> Iterator[tuple[str, collections.Counter[tuple[str, int]]]]:
    """Serve `app` over HTTP on a free port, counting requests by (path, status)."""
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    inner = app.wsgi_app

    def counting(environ: dict[str, Any], start_response: Any) -> Any:
        def record(status: str, headers: Any, exc_info: Any = None) -> Any:
            counts[(environ["PATH_INFO"], int(status.split()[0]))] += 1
            return start_response(status, headers, exc_info)

        return inner(environ, record)

    app.wsgi_app = counting  # type: ignore[method-assign]
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", counts
    finally:
        server.shutdown()
        thread.join(5)


def test_a_polled_sdk_future_backs_off_while_postgres_is_down(
    stack: Stack, make_app: Callable[..., Flask]
) -> None:
    outage = 4.0
    app = make_app(long_poll_seconds=2.0)  # a held 503 lasts min(Retry-After, a long-poll)
    with _served(app) as (base_url, counts):
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
    assert seen and set(seen) == {200}, seen
    assert set(polled) == {200}, polled
