"""`treadle status` and its route, GET /api/v1/treadle/status: the served platform's two workers
with fresh heartbeats, a new session counted under its tenant, the CLI's table and `--json`; and,
on an in-process API whose only worker is a heartbeat row (nothing it admits ever runs), the
pending operations, the oldest of them, each worker's queue and a dead worker told apart."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from tests.conftest import Platform
from tests.integration.wire_client import WireClient
from tests.secure_app import FAKE_WORKER, SecureApp, running_secure_app
from treadle.client.admin import AdminClient
from treadle.client.rest import TreadleApiError
from treadle.platform.sessions import leases
from treadle.platform.tenancy import keys

pytestmark = pytest.mark.integration

STATUS = "/api/v1/treadle/status"
METRICS_URL = "http://10.0.0.7:9101/metrics"


def _platform_workers(platform: Platform) -> list[str]:
    """The ids of the workers this `treadle up` runs (its state file names them)."""
    state = json.loads((platform.data_dir / "up.json").read_text())
    return sorted(state["workers"])


def _tenant_keys(platform: Platform) -> tuple[str, str, str]:
    """A new tenant through the operator: (its id, its admin key, a member key of it)."""
    tenant_id = f"status-{secrets.token_hex(4)}"
    admin_key = AdminClient(platform.base_url, platform.admin_key).create_tenant(tenant_id)
    member = AdminClient(platform.base_url, admin_key["api_key"]).create_key(role="member")
    return tenant_id, admin_key["api_key"], member["api_key"]


def _status_cli(platform: Platform, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TREADLE_BASE_URL": platform.base_url,
           "TREADLE_API_KEY": platform.admin_key}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "treadle.cli", "status", *flags],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_status_lists_both_live_workers_with_fresh_heartbeats(platform: Platform) -> None:
    status = AdminClient(platform.base_url, platform.admin_key).status()
    ours = _platform_workers(platform)
    assert len(ours) == 2
    listed = {w["id"]: w for w in status["workers"]}
    for worker_id in ours:
        worker = listed[worker_id]
        assert worker["is_alive"] is True
        # Workers heartbeat every second; 5 s leaves room for a busy machine.
        assert 0 <= worker["heartbeat_age_seconds"] < 5, worker
        assert worker["sessions"] >= 0 and worker["queued"] >= 0
    assert status["lease_ttl_seconds"] == 10


def test_status_counts_a_new_session_under_its_tenant(platform: Platform) -> None:
    tenant_id, admin_key, _ = _tenant_keys(platform)
    admin = AdminClient(platform.base_url, platform.admin_key)
    assert tenant_id not in admin.status()["live_sessions"]
    model_id = WireClient(platform.base_url, admin_key).create_model()
    status = admin.status()
    assert status["live_sessions"][tenant_id] == 1
    # The session is leased to one of this platform's workers, which counts it as held.
    holders = [w for w in status["workers"] if w["id"] in _platform_workers(platform)]
    assert sum(w["sessions"] for w in holders) >= 1
    stop = WireClient(platform.base_url, admin_key).http.post(
        f"/api/v1/treadle/sessions/{model_id}/stop", json={}
    )
    assert stop.status_code == 200, stop.text
    assert tenant_id not in admin.status()["live_sessions"]


def test_status_refuses_a_member_and_a_tenant_admin_with_403(platform: Platform) -> None:
    _, admin_key, member_key = _tenant_keys(platform)
    for key in (member_key, admin_key):
        with pytest.raises(TreadleApiError) as refused:
            AdminClient(platform.base_url, key).status()
        assert refused.value.status == 403
        assert "operator" in str(refused.value) and "TREADLE_ADMIN_KEY" in str(refused.value)


def test_the_cli_prints_tables_and_its_json_parses(platform: Platform) -> None:
    tenant_id, admin_key, _ = _tenant_keys(platform)
    WireClient(platform.base_url, admin_key).create_model()
    table = _status_cli(platform)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("Workers: ") and "alive of" in lines[0]
    assert lines[1].split() == [
        "worker", "heartbeat_age", "alive", "sessions", "queued", "ranks", "layout", "metrics_url"
    ]  # fmt: skip
    for worker_id in _platform_workers(platform):
        row = next(line for line in lines if line.startswith(worker_id))
        assert row.split()[3] == "yes", row  # id, age, "s", alive
    assert any(line.split() == [tenant_id, "1"] for line in lines), table.stdout
    assert any(line.startswith("Pending operations: ") for line in lines)

    as_json = _status_cli(platform, "--json")
    assert as_json.returncode == 0, as_json.stderr
    body = json.loads(as_json.stdout)
    assert body["live_sessions"][tenant_id] == 1
    assert set(_platform_workers(platform)) <= {w["id"] for w in body["workers"]}


def test_the_cli_says_who_may_call_it(platform: Platform) -> None:
    _, _, member_key = _tenant_keys(platform)
    env = {**os.environ, "TREADLE_BASE_URL": platform.base_url, "TREADLE_API_KEY": member_key}
    refused = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "status"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.startswith("treadle status: 403: ")
    assert "operator" in refused.stderr


# --- pending operations, on an API whose worker never runs anything --------------------------


@pytest.fixture(scope="module")
def quiet_api(services: Any) -> Iterator[SecureApp]:
    """The API in process on a database of its own: its one worker is a heartbeat row, so what
    it admits stays pending, and no other test's operation is older than this module's."""
    with running_secure_app(services) as app:
        yield app


def _ok(response: Any) -> Any:
    assert response.status_code < 300, response.get_data(as_text=True)
    return response.get_json()


def test_status_shows_pending_operations_the_oldest_and_each_workers_queue(
    quiet_api: SecureApp,
) -> None:
    before = _ok(quiet_api.call("GET", STATUS, quiet_api.operator_key))
    assert (before["pending_operations"], before["oldest_pending"]) == (0, None)
    assert before["live_sessions"] == {}
    with quiet_api.engine.begin() as conn:
        leases.heartbeat_worker(conn, FAKE_WORKER, {"metrics_url": METRICS_URL})
        _, key = keys.create_tenant_key(conn, "status-quiet", "admin")
    session = _ok(quiet_api.call("POST", "/api/v1/create_session", key, json={"tags": []}))
    model = _ok(
        quiet_api.call(
            "POST",
            "/api/v1/create_model",
            key,
            json={
                "session_id": session["session_id"],
                "model_seq_id": 0,
                "base_model": "treadle/tiny-debug",
                "lora_config": {"rank": 4},
            },
        )  # fmt: skip
    )
    step = _ok(
        quiet_api.call(
            "POST",
            "/api/v1/optim_step",
            key,
            json={
                "model_id": model["model_id"],
                "seq_id": 1,
                "adam_params": {"learning_rate": 1e-3},
            },
        )  # fmt: skip
    )
    assert step["request_id"] != model["request_id"]
    with quiet_api.engine.begin() as conn:  # a worker silent for longer than the lease TTL
        leases.heartbeat_worker(conn, "worker-gone", {})
        conn.execute(
            sa.text(
                "UPDATE workers SET heartbeat_at = now() - interval '2 days' WHERE id = 'worker-gone'"
            )
        )

    status = _ok(quiet_api.call("GET", STATUS, quiet_api.operator_key))

    assert status["pending_operations"] == 2
    oldest = status["oldest_pending"]
    assert oldest["request_id"] == model["request_id"]  # create_model came first
    assert (oldest["session_id"], oldest["tenant_id"]) == (model["model_id"], "status-quiet")
    assert (oldest["type"], oldest["seq_id"]) == ("create_model", 0)
    assert 0 <= oldest["age_seconds"] < 60
    assert status["live_sessions"] == {"status-quiet": 1}
    workers = {w["id"]: w for w in status["workers"]}
    assert workers[FAKE_WORKER] == {
        "id": FAKE_WORKER,
        "heartbeat_age_seconds": workers[FAKE_WORKER]["heartbeat_age_seconds"],
        "is_alive": True,
        "sessions": 1,
        "queued": 2,
        "metrics_url": METRICS_URL,
        "device": None,  # the fake worker's heartbeat does not say
        "world_size": 1,
        "layout": None,  # one process, not a group
        "memory": None,  # its heartbeat reports no budget: admission judges it as before
    }
    assert workers[FAKE_WORKER]["heartbeat_age_seconds"] < 60
    gone = workers["worker-gone"]
    assert gone["is_alive"] is False and gone["heartbeat_age_seconds"] > 2 * 86400 - 60
    assert (gone["sessions"], gone["queued"], gone["metrics_url"]) == (0, 0, None)
