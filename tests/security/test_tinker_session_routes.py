"""The Tinker session routes in process (`secure`): bad paging, bodies and days are 400s that
name the field; answers validate as the SDK's own types; statuses map as documented; a trace
of a pending operation is still one event; a trace link is a 404 once unknown or too long.
The served platform with the real SDK and CLI: tests/integration/test_tinker_sessions.py."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
import sqlalchemy as sa
from tinker import types

from tests.secure_app import SecureApp
from treadle.platform.tenancy import keys, tenants

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"


def _key(secure: SecureApp, role: str = "admin", tenant_id: str | None = None) -> str:
    tenant_id = tenant_id or f"routes-{secrets.token_hex(3)}"
    with secure.engine.begin() as conn:
        tenants.ensure_tenant(conn, tenant_id)
        return keys.create_tenant_key(conn, tenant_id, role)[1]


def _ok(response: Any) -> Any:
    assert response.status_code == 200, response.get_data(as_text=True)
    return response.get_json()


def _error(response: Any, status: int) -> str:
    assert response.status_code == status, response.get_data(as_text=True)
    return str(response.get_json()["error"]["message"])


def _session(
    secure: SecureApp,
    key: str,
    metadata: dict[str, Any] | None = None,
    display_name: str | None = None,
) -> str:
    body = {"tags": [], "user_metadata": metadata or {}, "display_name": display_name}
    return str(_ok(secure.call("POST", "/api/v1/create_session", key, json=body))["session_id"])


@pytest.mark.parametrize(
    ("query", "field"),
    [("limit=0", "limit"), ("limit=1001", "limit"), ("limit=ten", "limit"),
     ("offset=-1", "offset"), ("offset=" + "9" * 40, "offset"), ("access_scope=mine", "access_scope")],
)  # fmt: skip
def test_bad_paging_is_a_400_naming_the_field(secure: SecureApp, query: str, field: str) -> None:
    message = _error(secure.call("GET", f"/api/v1/sessions?{query}", _key(secure)), 400)
    assert field in message


@pytest.mark.parametrize(
    ("body", "field"),
    [({"limit": 201}, "limit"), ({"owner": {"type": "everyone"}}, "owner"),
     ({"owner": {"type": "user", "owner_urns": []}}, "owner_urns"),
     ({"statuses": []}, "statuses"), ({"cursor": {"last_session_id": "x"}}, "last_created_at"),
     ({"display_name": ""}, "display_name"), ({"project_ids": ["someone-else"]}, "project_ids")],
)  # fmt: skip
def test_bad_searches_are_a_400_naming_the_field(
    secure: SecureApp, body: dict[str, Any], field: str
) -> None:
    message = _error(secure.call("POST", "/api/v1/sessions/search", _key(secure), json=body), 400)
    assert field in message


def test_answers_validate_as_the_sdks_types(secure: SecureApp) -> None:
    key = _key(secure)
    session = _session(secure, key, {"n": 3, "s": "x"})
    listed = _ok(secure.call("GET", "/api/v1/sessions", key))
    assert types.ListSessionsResponse.model_validate(listed).sessions == [session]
    got = types.GetSessionResponse.model_validate(
        _ok(secure.call("GET", f"/api/v1/sessions/{session}", key))
    )
    assert (got.training_run_ids, got.sampler_ids, got.user_metadata) == (
        [],
        [],
        {"n": "3", "s": "x"},
    )
    found = types.SessionSearchResponse.model_validate(
        _ok(secure.call("POST", "/api/v1/sessions/search", key, json={}))
    )
    assert [s.session_id for s in found.sessions] == [session] and found.next_cursor is None
    audit = _ok(secure.call("GET", "/api/v1/audit?event_type=all&day=2026-01-02", key))
    assert types.AuditLogResponse.model_validate(audit).entries == []


def test_owned_is_the_keys_own_and_accessible_the_tenants(secure: SecureApp) -> None:
    tenant_id = f"routes-{secrets.token_hex(3)}"
    admin, member = _key(secure, "admin", tenant_id), _key(secure, "member", tenant_id)
    session = _session(secure, admin)
    assert _ok(secure.call("GET", "/api/v1/sessions", member))["sessions"] == []
    accessible = _ok(secure.call("GET", "/api/v1/sessions?access_scope=accessible", member))
    assert accessible["sessions"] == [session]
    _error(secure.call("GET", f"/api/v1/sessions/{session}", member), 404)
    _ok(secure.call("GET", f"/api/v1/sessions/{session}?access_scope=accessible", member))


def test_statuses_map_running_finished_and_expired(secure: SecureApp) -> None:
    key = _key(secure)
    running, finished, expired = (_session(secure, key) for _ in range(3))
    _ok(secure.call("POST", f"/api/v1/sessions/{finished}/finish", key, json={}))
    with secure.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE client_sessions SET status = 'Expired' WHERE id = :id"), {"id": expired}
        )

    def search(*statuses: dict[str, Any]) -> list[str]:
        body = {"statuses": list(statuses)} if statuses else {}
        page = _ok(secure.call("POST", "/api/v1/sessions/search", key, json=body))
        return [s["session_id"] for s in page["sessions"]]

    assert search() == [expired, finished, running]
    assert search({"type": "active"}) == [running]
    assert search({"type": "client_finished", "reasons": ["success"]}) == [finished]
    assert search({"type": "client_finished", "reasons": ["errored"]}) == []
    assert search({"type": "cancelled"}) == [expired]
    assert search({"type": "failed"}) == []
    page = _ok(secure.call("POST", "/api/v1/sessions/search", key, json={}))
    status = {s["session_id"]: s["status"] for s in page["sessions"]}
    assert status[finished] == {"type": "client_finished", "reason": {"type": "success"}}
    assert status[expired]["type"] == "cancelled"


def test_display_name_matches_words_literally_or_with_an_id_either(secure: SecureApp) -> None:
    key = _key(secure)
    named = _session(secure, key, display_name="Nightly 100% run_a")
    other = _session(secure, key)
    url = "/api/v1/sessions/search"

    def found(body: dict[str, Any]) -> list[str]:
        return [s["session_id"] for s in _ok(secure.call("POST", url, key, json=body))["sessions"]]

    assert found({"display_name": "NIGHTLY run_a"}) == [named]
    assert found({"display_name": "100%"}) == [named]
    assert found({"display_name": "1%0"}) == []  # % and _ are literal, not wildcards
    assert found({"display_name": "run_b"}) == []
    assert found({"display_name": "x", "session_id": other}) == [other]


def test_a_pending_operation_is_one_event_ending_at_the_export(secure: SecureApp) -> None:
    secure.keep_worker_alive()
    key = _key(secure)
    session = _session(secure, key)
    model = {"session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL}
    created = _ok(secure.call("POST", "/api/v1/create_model", key, json=model))
    link = _ok(secure.call("GET", f"/api/v1/sessions/{session}/trace_export", key))
    assert link["status"] == "ready"
    path = link["url"].split("://", 1)[1].split("/", 1)[1]
    download = secure.call("GET", "/" + path, None)  # no key
    assert download.status_code == 200 and download.headers["Cache-Control"] == "no-store"
    trace = json.loads(download.get_data())
    (span,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert span["name"] == "create_model" and span["pid"] == 1 and span["dur"] >= 0
    assert span["args"] == {
        "request_id": created["request_id"], "seq_id": 0, "status": "pending", "tokens": None,
    }  # fmt: skip
    names = {e["name"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"process_name": created["model_id"], "thread_name": "create_model"}


@pytest.mark.parametrize(
    "token", ["nope", "x" * 129, secrets.token_urlsafe(32)], ids=["short", "too-long", "unknown"]
)
def test_an_unknown_trace_link_is_a_404(secure: SecureApp, token: str) -> None:
    message = _error(secure.call("GET", f"/api/v1/treadle/traces/{token}", None), 404)
    assert "export the trace again" in message


def test_the_audit_log_checks_its_query_and_role(secure: SecureApp) -> None:
    admin = _key(secure)
    assert "event_type" in _error(secure.call("GET", "/api/v1/audit?event_type=x", admin), 400)
    assert "day" in _error(secure.call("GET", "/api/v1/audit?day=2026-13-01", admin), 400)
    projects = _ok(secure.call("GET", "/api/v1/audit?event_type=projects", admin))
    assert projects == {"entries": [], "truncated": False}
    member = _key(secure, "member")
    assert "admin key" in _error(secure.call("GET", "/api/v1/audit", member), 403)
