"""The audit trail against the served platform (`treadle up`: API, real workers): one 30-operation
session of a tenant of this module's own, read back through the timeline, the paged events, the
session listing and the `treadle audit` / `treadle sessions list` commands, each compared with the
database (events, operations and the usage ledger); another tenant sees none of it, the operator
all of it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from tinker import types

import treadle
from tests.conftest import Platform
from tests.integration.wire_client import datum
from treadle.client.admin import AdminClient
from treadle.client.audit import AuditClient

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
OPERATIONS = 30


@dataclass(frozen=True)
class Audited:
    platform: Platform
    tenant: str
    key: str  # a member key of the tenant: the actor of every operation
    key_id: str
    other_key: str  # an admin key of another tenant
    model_id: str

    def get(self, path: str, key: str | None = None, **params: Any) -> httpx.Response:
        return httpx.get(
            f"{self.platform.base_url}/api/v1/treadle{path}",
            params=params,
            headers={"X-API-Key": key or self.key},
            timeout=30,
        )

    def cli(self, *argv: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "TREADLE_BASE_URL": self.platform.base_url,
            "TREADLE_API_KEY": key or self.key,
        }
        return subprocess.run(
            [sys.executable, "-m", "treadle.cli", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.fixture(scope="module")
def audited(platform: Platform) -> Iterator[Audited]:
    operator = AdminClient(platform.base_url, platform.admin_key)
    tenant = f"audit-{secrets.token_hex(3)}"
    tenant_admin = AdminClient(platform.base_url, operator.create_tenant(tenant)["api_key"])
    member = tenant_admin.create_key(role="member", name="auditor")
    other_key = operator.create_tenant(f"audit-other-{secrets.token_hex(3)}")["api_key"]
    operator.close()
    tenant_admin.close()
    svc = treadle.ServiceClient(base_url=platform.base_url, api_key=member["api_key"])
    with svc.create_lora_training_client(BASE_MODEL, training_session_name="audited", rank=4) as tc:
        for step in range(10):  # create_model and 20 more: 21
            tc.forward_backward([datum([1, 2, 3, 4, 5 + step])], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-3))
        tc.forward([datum([7, 8, 9])], "cross_entropy").result()  # 22
        tc.save_state("audit-1").result()  # 23
        sampler = tc.save_weights_and_get_sampling_client()  # 24
        params = types.SamplingParams(max_tokens=3, temperature=0.0)
        for prompt in ([1, 2], [3, 4, 5], [6]):  # 27
            sampler.sample(prompt, num_samples=1, sampling_params=params).result()
        for prompt in ([1, 2, 3], [4, 5, 6, 7]):  # 29
            sampler.compute_logprobs(prompt).result()
        tc.save_state("audit-2").result()  # 30
        model_id = tc.model_id
    svc.close()
    yield Audited(platform, tenant, member["api_key"], member["key"]["id"], other_key, model_id)


def _db_events(engine: sa.Engine, model_id: str) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT * FROM events WHERE session_id = :s ORDER BY position"), {"s": model_id}
        ).all()


def _ledger(engine: sa.Engine, model_id: str) -> dict[str, Any]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT * FROM usage WHERE session_id = :s"), {"s": model_id}
        ).all()
    return {r.request_id: r for r in rows}


def test_the_timeline_shows_every_operation_with_actor_durations_tokens_and_outcome(
    audited: Audited, engine: sa.Engine
) -> None:
    rows = AuditClient(audited.platform.base_url, audited.key).timeline(audited.model_id)
    ops = [r for r in rows if r["kind"] == "operation"]
    with engine.connect() as conn:
        db_ops = {
            r.request_id: r
            for r in conn.execute(
                sa.text("SELECT * FROM operations WHERE session_id = :s"), {"s": audited.model_id}
            )
        }
    ledger = _ledger(engine, audited.model_id)
    assert len(ops) == OPERATIONS == len(db_ops) == len(ledger), " ".join(r["type"] for r in ops)
    assert {r["request_id"] for r in ops} == set(db_ops)
    for row in ops:
        assert row["actor"] == audited.key_id, row
        assert row["status"] == "completed", row
        assert row["execution_ms"] > 0 and row["queue_wait_ms"] >= 0, row
        used = ledger[row["request_id"]]
        assert row["tokens"] == {
            "prefill": used.prefill_tokens,
            "sample": used.sample_tokens,
            "train": used.train_tokens,
        }
        metrics = (db_ops[row["request_id"]].result or {}).get("metrics") or {}
        assert row["loss"] == metrics.get("loss:sum"), row
    losses = [r for r in ops if r["type"] == "forward_backward"]
    assert len(losses) == 11 and all(r["outcome"].startswith("loss:sum=") for r in losses)
    assert sum(r["tokens"]["train"] for r in ops) == sum(u.train_tokens for u in ledger.values())
    session_events = [r["type"] for r in rows if r["kind"] == "event"]
    assert session_events[0] == "SessionCreated" and session_events[-1] == "SessionStopped"
    assert "SessionLeased" in session_events
    assert session_events.count("CheckpointSaved") == 2
    # Every event but the settlements is one row, in seq order.
    expected = [
        e.seq
        for e in _db_events(engine, audited.model_id)
        if e.type not in ("OperationCompleted", "OperationFailed")
    ]
    assert [r["seq"] for r in rows] == expected


def test_paging_with_a_small_limit_returns_every_event_exactly_once(
    audited: Audited, engine: sa.Engine
) -> None:
    positions: list[int] = []
    after, pages = 0, 0
    while True:
        response = audited.get(f"/sessions/{audited.model_id}/events", after=after, limit=7)
        assert response.status_code == 200, response.text
        page = response.json()
        assert len(page["events"]) <= 7
        positions += [e["position"] for e in page["events"]]
        after, pages = page["next_after"], pages + 1
        if not page["has_more"]:
            break
    db = [e.position for e in _db_events(engine, audited.model_id)]
    assert positions == db and len(set(positions)) == len(db)
    assert pages == -(-len(db) // 7)
    client = AuditClient(audited.platform.base_url, audited.key)
    full_timeline = client.timeline(audited.model_id)
    assert client.timeline(audited.model_id, page_size=7) == full_timeline


def test_follow_yields_every_event_and_ends_once_the_session_is_over(
    audited: Audited, engine: sa.Engine
) -> None:
    client = AuditClient(audited.platform.base_url, audited.key)
    followed = [e["position"] for e in client.follow(audited.model_id, poll=0.1)]
    assert followed == [e.position for e in _db_events(engine, audited.model_id)]


def test_large_payloads_are_summarised_unless_full(audited: Audited) -> None:
    client = AuditClient(audited.platform.base_url, audited.key)
    wanted = ["OperationRequested"]
    short = [e for e in client.events(audited.model_id, wanted) if e["data"]["type"] == "sample"]
    full = [
        e for e in client.events(audited.model_id, wanted, True) if e["data"]["type"] == "sample"
    ]
    assert [e["position"] for e in short] == [e["position"] for e in full] and len(short) == 5
    assert short[0]["data"]["payload"]["summary"] is True
    assert short[0]["data"]["payload"]["prompt_tokens"] == len(full[0]["data"]["payload"]["prompt"])
    assert "summary" not in full[0]["data"]["payload"]
    fb = client.events_page(audited.model_id, limit=1000, types=wanted)["events"]
    payload = next(e["data"]["payload"] for e in fb if e["data"]["type"] == "forward_backward")
    assert payload["summary"] is True and payload["datums"] == 1 and payload["tokens"] == 4
    assert payload["loss_fn"] == "cross_entropy" and "data" not in payload


def test_another_tenants_key_gets_404_as_for_a_missing_session(audited: Audited) -> None:
    missing = audited.model_id.replace(":train:", ":train:9")
    for route in ("events", "timeline"):
        theirs = audited.get(f"/sessions/{audited.model_id}/{route}", key=audited.other_key)
        none = audited.get(f"/sessions/{missing}/{route}", key=audited.other_key)
        assert theirs.status_code == none.status_code == 404
        assert theirs.json()["error"]["message"] == none.json()["error"]["message"].replace(
            missing, audited.model_id
        )
    listing = audited.get("/sessions", key=audited.other_key, limit=1000)
    assert listing.status_code == 200
    assert audited.model_id not in {s["model_id"] for s in listing.json()["sessions"]}
    named = audited.get("/sessions", key=audited.other_key, tenant=audited.tenant)
    assert named.status_code == 403


def test_the_operator_reads_any_tenants_session(audited: Audited) -> None:
    operator = audited.platform.admin_key
    for route in ("events", "timeline"):
        assert audited.get(f"/sessions/{audited.model_id}/{route}", key=operator).status_code == 200
    client = AuditClient(audited.platform.base_url, operator)
    assert audited.model_id in {s["model_id"] for s in client.list_sessions(tenant=audited.tenant)}
    everyone = client.list_sessions(tenant="*", kind="training")
    assert audited.model_id in {s["model_id"] for s in everyone}


def test_bad_query_arguments_are_400s_that_say_how_to_fix_them(audited: Audited) -> None:
    events = f"/sessions/{audited.model_id}/events"
    for path, params, says in (
        (events, {"limit": "0"}, "between 1 and 1000"),
        (events, {"after": "-1"}, "between 0 and"),
        (events, {"after": "x"}, "must be an integer"),
        (events, {"type": "Bogus"}, "use any of"),
        (events, {"full": "maybe"}, "true or false"),
        ("/sessions", {"status": "sleeping"}, "use one of"),
        ("/sessions", {"since": "2026-13-01"}, "YYYY-MM-DD"),
        ("/sessions", {"kind": "Not A Kind"}, "training"),
    ):
        response = audited.get(path, **params)
        assert response.status_code == 400, (params, response.text)
        assert says in response.json()["error"]["message"], response.text


def test_audit_export_writes_every_event_as_the_database_holds_it(
    audited: Audited, engine: sa.Engine, tmp_path: Path
) -> None:
    out = tmp_path / "events.jsonl"
    done = audited.cli("audit", audited.model_id, "--export", str(out))
    assert done.returncode == 0, done.stderr
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    db = _db_events(engine, audited.model_id)
    assert len(exported) == len(db)
    for line, row in zip(exported, db, strict=True):
        assert set(line) == {
            "position", "seq", "type", "data", "actor", "created_at", "tenant_id", "session_id"
        }  # fmt: skip
        assert (line["position"], line["seq"], line["type"], line["actor"]) == (
            row.position, row.seq, row.type, row.actor,
        )  # fmt: skip
        assert (line["tenant_id"], line["session_id"]) == (row.tenant_id, row.session_id)
        assert line["data"] == row.data
        assert datetime.fromisoformat(line["created_at"]) == row.created_at


def test_audit_follow_on_a_stopped_session_ends_by_itself(audited: Audited) -> None:
    done = audited.cli("audit", audited.model_id, "--follow", "--poll", "0.2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:4] == ["time", "seq", "type", "actor"]
    operation_lines = [line for line in lines[1:] if any(f" {t} " in line for t in _OP_TYPES)]
    assert len(operation_lines) == OPERATIONS
    assert "SessionStopped" in lines[-1]


def test_audit_json_prints_one_row_per_line(audited: Audited) -> None:
    done = audited.cli("audit", audited.model_id, "--json")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert sum(r["kind"] == "operation" for r in rows) == OPERATIONS
    assert all(r["actor"] == audited.key_id for r in rows if r["kind"] == "operation")


def test_sessions_list_shows_operations_and_tokens_equal_to_the_ledger(
    audited: Audited, engine: sa.Engine
) -> None:
    done = audited.cli("sessions", "list", "--format", "json", "--kind", "training")
    assert done.returncode == 0, done.stderr
    listed = {s["model_id"]: s for s in json.loads(done.stdout)["sessions"]}
    row = listed[audited.model_id]
    ledger = _ledger(engine, audited.model_id).values()
    assert row["operations"] == len(ledger) == OPERATIONS
    assert (row["prefill_tokens"], row["sample_tokens"], row["train_tokens"]) == (
        sum(u.prefill_tokens for u in ledger),
        sum(u.sample_tokens for u in ledger),
        sum(u.train_tokens for u in ledger),
    )
    assert row["cost_micro_usd"] == sum(u.cost_micro_usd for u in ledger)
    assert (row["owner"], row["rank"], row["status"]) == (audited.key_id, 4, "Stopped")
    assert (row["name"], row["base_model"], row["tenant_id"]) == (
        "audited", BASE_MODEL, audited.tenant,
    )  # fmt: skip


_OP_TYPES = (
    "create_model",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "sample",
)
