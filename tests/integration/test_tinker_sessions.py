"""The Tinker protocol's session routes against the served platform (`treadle up`, real workers),
through the official SDK (`tinker.ServiceClient`, `RestClient`, `AdminClient`) and the official
`tinker session export-trace` command run as a subprocess: a tenant sees its own client sessions
and never another tenant's; a trace has one event per operation; a trace link works without a
key until it expires; the audit log shows the checkpoint a session saved. tinker 0.38.0's CLI
has no `session list` command (only `export-trace`), so listings go through the SDK."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import tinker
from tinker import types

from tests.conftest import Platform
from tests.integration.wire_client import datum
from treadle.client.admin import AdminClient
from treadle.platform import db

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
METADATA = {"suite": "tinker-sessions"}


@dataclass(frozen=True)
class Tenant:
    id: str
    key: str
    key_id: str


@dataclass(frozen=True)
class World:
    """Tenant A's client session (`session`: a few operations, a checkpoint, a sample) and an
    older one of A's (`idle`), tenant B's own session, and a member key of A."""

    platform: Platform
    a: Tenant
    b: Tenant
    a_member_key: str
    session: str
    idle: str
    b_session: str
    model_id: str
    sampler_id: str
    checkpoint: str
    engine: sa.Engine

    def rest(self, key: str) -> tinker.RestClient:
        return tinker.RestClient(base_url=self.platform.base_url, api_key=key)


def _tenant(admin: AdminClient, prefix: str) -> Tenant:
    tenant_id = f"{prefix}-{secrets.token_hex(3)}"
    made = admin.create_tenant(tenant_id)
    return Tenant(tenant_id, made["api_key"], made["key"]["id"])


def _create_session(platform: Platform, key: str) -> str:
    response = httpx.post(
        f"{platform.base_url}/api/v1/create_session",
        json={"tags": [], "user_metadata": {}},
        headers={"X-API-Key": key},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["session_id"])


@pytest.fixture(scope="module")
def world(platform: Platform) -> Iterator[World]:
    admin = AdminClient(platform.base_url, platform.admin_key)
    a, b = _tenant(admin, "sessions-a"), _tenant(admin, "sessions-b")
    admin.close()
    a_admin = AdminClient(platform.base_url, a.key)
    member = a_admin.create_key(role="member")["api_key"]
    a_admin.close()
    idle = _create_session(platform, a.key)  # older than `session`
    b_session = _create_session(platform, b.key)
    svc = tinker.ServiceClient(
        METADATA, base_url=platform.base_url, api_key=a.key, display_name="Nightly SFT run"
    )
    tc = svc.create_lora_training_client(BASE_MODEL, rank=4, seed=1).result()
    for _ in range(2):
        tc.forward_backward([datum([1, 2, 3, 4, 5])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    checkpoint = tc.save_state("sessions-ckpt").result().path
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params).result()
    model_id = tc.model_id
    engine = db.connect(platform.database_url, pool_size=1)
    with engine.connect() as conn:
        sampler_id = conn.execute(
            sa.text("SELECT id FROM samplers WHERE session_id = :m"), {"m": model_id}
        ).scalar_one()
    yield World(
        platform, a, b, member, model_id.split(":train:")[0], idle, b_session, model_id,
        sampler_id, checkpoint, engine,
    )  # fmt: skip
    svc.close("success").result()
    engine.dispose()


def _search(
    rest: tinker.RestClient, request: types.SessionSearchRequest
) -> types.SessionSearchResponse:
    with warnings.catch_warnings():  # search_sessions is experimental in tinker 0.38
        warnings.simplefilter("ignore")
        return rest.search_sessions(request).result()


def test_list_sessions_shows_the_tenants_sessions_newest_first(world: World) -> None:
    rest = world.rest(world.a.key)
    listed = rest.list_sessions(limit=1000).result().sessions
    assert world.session in listed and world.idle in listed
    assert listed.index(world.session) < listed.index(world.idle)
    assert world.b_session not in listed
    other = world.rest(world.b.key).list_sessions(limit=1000).result()
    assert world.session not in other.sessions and world.b_session in other.sessions


def test_list_sessions_pages_and_validates_its_paging(world: World) -> None:
    rest = world.rest(world.a.key)
    everything = rest.list_sessions(limit=1000).result().sessions
    assert rest.list_sessions(limit=1, offset=1).result().sessions == everything[1:2]
    with pytest.raises(tinker.BadRequestError, match="limit"):
        rest.list_sessions(limit=1001).result()


def test_get_session_lists_its_training_runs_samplers_and_metadata(world: World) -> None:
    got = world.rest(world.a.key).get_session(world.session).result()
    assert got.training_run_ids == [world.model_id]
    assert got.sampler_ids == [world.sampler_id]
    assert got.user_metadata == METADATA
    assert got.display_name == "Nightly SFT run"


def test_search_by_display_name_matches_every_word_in_any_case(world: World) -> None:
    rest = world.rest(world.a.key)
    for name in ("nightly", "SFT NIGHTLY", "run sft"):
        page = _search(rest, types.SessionSearchRequest(display_name=name))
        assert [s.session_id for s in page.sessions] == [world.session], name
        assert page.sessions[0].display_name == "Nightly SFT run"
    for name in ("nightly eval", "100%", "_"):
        assert _search(rest, types.SessionSearchRequest(display_name=name)).sessions == [], name


def test_another_tenants_session_is_a_404_like_a_missing_one(world: World) -> None:
    rest = world.rest(world.b.key)
    with pytest.raises(tinker.NotFoundError) as theirs:
        rest.get_session(world.session, access_scope="accessible").result()
    missing = "sess-" + "0" * 16
    with pytest.raises(tinker.NotFoundError) as nothing:
        rest.get_session(missing, access_scope="accessible").result()
    assert str(theirs.value).replace(world.session, "ID") == str(nothing.value).replace(
        missing, "ID"
    )


def test_search_finds_the_tenants_sessions_with_owner_project_status_storage(
    world: World,
) -> None:
    rest = world.rest(world.a.key)
    page = _search(rest, types.SessionSearchRequest(owner=types.AccessibleSearchOwner()))
    found = {s.session_id: s for s in page.sessions}
    assert world.session in found and world.idle in found and world.b_session not in found
    mine = found[world.session]
    assert (mine.owner, mine.project_id) == (world.a.key_id, world.a.id)
    assert isinstance(mine.status, types.SessionActive)
    assert mine.checkpoints_count == 1 and (mine.checkpoint_storage_bytes or 0) > 0
    assert mine.user_metadata == METADATA
    assert found[world.idle].checkpoints_count == 0


def test_search_pages_by_cursor_and_filters(world: World) -> None:
    rest = world.rest(world.a.key)
    first = _search(rest, types.SessionSearchRequest(limit=1))
    assert [s.session_id for s in first.sessions] == [world.session]
    assert first.next_cursor is not None
    second = _search(rest, types.SessionSearchRequest(limit=1, cursor=first.next_cursor))
    assert [s.session_id for s in second.sessions] == [world.idle]
    by_metadata = _search(rest, types.SessionSearchRequest(user_metadata=METADATA))
    assert [s.session_id for s in by_metadata.sessions] == [world.session]
    finished = types.ClientFinishedSessionStatusQuery()
    assert _search(rest, types.SessionSearchRequest(statuses=[finished])).sessions == []
    member = world.rest(world.a_member_key)
    assert _search(member, types.SessionSearchRequest()).sessions == []  # it opened none


def _export(world: World, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINKER_BASE_URL": world.platform.base_url, "TINKER_API_KEY": key}
    return subprocess.run(
        [sys.executable, "-m", "tinker.cli", "session", "export-trace", *args],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_export_trace_writes_one_event_per_operation(world: World, tmp_path: Path) -> None:
    out = tmp_path / "trace.pftrace"
    done = _export(world, world.a.key, world.session, "-o", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    trace = json.loads(out.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    with world.engine.connect() as conn:
        expected = dict(
            conn.execute(
                sa.text(
                    "SELECT o.request_id, o.type FROM operations o JOIN sessions s "
                    "ON s.id = o.session_id WHERE s.client_session_id = :c"
                ),
                {"c": world.session},
            ).all()
        )
    assert {e["args"]["request_id"]: e["name"] for e in spans} == expected
    assert len(spans) == len(expected) == 7  # create, 2 x fb, optim, save x 2, sample
    assert all(e["args"]["status"] == "completed" and e["dur"] >= 0 for e in spans)
    fb = next(e for e in spans if e["name"] == "forward_backward")
    assert fb["args"]["tokens"]["train"] == 4


def test_another_tenants_key_cannot_export_a_trace(world: World, tmp_path: Path) -> None:
    out = tmp_path / "theirs.pftrace"
    done = _export(world, world.b.key, world.session, "-o", str(out))
    assert done.returncode != 0
    assert not out.exists()


def test_a_trace_link_needs_no_key_until_it_expires(world: World) -> None:
    done = _export(world, world.a.key, world.session, "--url-only")
    assert done.returncode == 0, done.stderr
    url = done.stdout.strip()
    assert httpx.get(url, timeout=30).status_code == 200
    token = url.rsplit("/", 1)[1]
    with world.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE trace_exports SET expires_at = now() WHERE token_hash = :h"),
            {"h": hashlib.sha256(token.encode()).hexdigest()},
        )
    expired = httpx.get(url, timeout=30)
    assert expired.status_code == 404
    assert "expired" in expired.json()["error"]["message"]
    unknown = httpx.get(url.rsplit("/", 1)[0] + "/" + secrets.token_urlsafe(32), timeout=30)
    assert unknown.status_code == 404


def _audit_day(world: World) -> Any:
    with world.engine.connect() as conn:
        created = conn.execute(
            sa.text("SELECT created_at FROM checkpoints WHERE tinker_path = :p"),
            {"p": world.checkpoint},
        ).scalar_one()
    return created.date()


def test_the_audit_log_lists_the_checkpoint_save(world: World) -> None:
    admin = tinker.AdminClient(base_url=world.platform.base_url, api_key=world.a.key)
    log = admin.get_audit_log("checkpoints", day=_audit_day(world)).result()
    saves = [e for e in log.entries if e.event == "checkpoint_create"]
    assert [e.tinker_path for e in saves] == [world.checkpoint]
    assert saves[0].event_details["actor"] == world.a.key_id
    assert saves[0].event_details["model_id"] == world.model_id
    everything = admin.get_audit_log("all", day=_audit_day(world)).result()
    assert {"training_run_create", "checkpoint_create"} <= {e.event for e in everything.entries}
    assert admin.get_audit_log("projects").result().entries == []


def test_the_audit_log_is_the_tenants_and_needs_an_admin_key(world: World) -> None:
    theirs = tinker.AdminClient(base_url=world.platform.base_url, api_key=world.b.key)
    entries = theirs.get_audit_log("all", day=_audit_day(world)).result().entries
    assert world.checkpoint not in json.dumps([e.model_dump(mode="json") for e in entries])
    member = tinker.AdminClient(base_url=world.platform.base_url, api_key=world.a_member_key)
    with pytest.raises(tinker.PermissionDeniedError):
        member.get_audit_log().result()
