"""Roles: only the operator creates, lists and disables tenants; a tenant admin manages its own
tenant's keys and nothing of another tenant; a member manages no key but its own. Creating a
tenant that exists is a 409 and never a new key (the takeover of issue 8)."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import sqlalchemy as sa

from tests.secure_app import SecureApp

pytestmark = pytest.mark.integration

TENANTS = "/api/v1/treadle/tenants"
KEYS = "/api/v1/treadle/keys"


def _tenant(secure: SecureApp, prefix: str = "roles") -> tuple[str, str, str]:
    """A new tenant through the operator: (tenant id, its admin key, that key's id)."""
    tenant_id = f"{prefix}-{secrets.token_hex(4)}"
    r = secure.call("POST", TENANTS, secure.operator_key, json={"id": tenant_id})
    assert r.status_code == 201, r.get_data(as_text=True)
    body = r.get_json()
    return tenant_id, body["api_key"], body["key"]["id"]


def _key(secure: SecureApp, admin_key: str, role: str = "member") -> tuple[str, str]:
    r = secure.call("POST", KEYS, admin_key, json={"role": role})
    assert r.status_code == 201, r.get_data(as_text=True)
    return r.get_json()["api_key"], r.get_json()["key"]["id"]


def _key_ids(secure: SecureApp, tenant_id: str) -> list[str]:
    with secure.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id FROM api_keys WHERE tenant_id = :t ORDER BY id"), {"t": tenant_id}
        )
        return list(rows.scalars())


def _error(response: Any) -> str:
    return str(response.get_json()["error"]["message"])


def test_operator_creates_a_tenant_with_one_admin_key(secure: SecureApp) -> None:
    tenant_id = f"roles-{secrets.token_hex(4)}"
    r = secure.call("POST", TENANTS, secure.operator_key, json={"id": tenant_id, "name": "Acme"})
    assert r.status_code == 201
    body = r.get_json()
    assert body["tenant"]["id"] == tenant_id and body["tenant"]["name"] == "Acme"
    assert body["key"]["role"] == "admin" and body["key"]["tenant_id"] == tenant_id
    assert body["api_key"].startswith("tml-")
    assert r.headers["Cache-Control"] == "no-store"
    assert _key_ids(secure, tenant_id) == [body["key"]["id"]]


def test_creating_an_existing_tenant_is_409_and_mints_no_key(secure: SecureApp) -> None:
    tenant_id, _, key_id = _tenant(secure)
    again = secure.call("POST", TENANTS, secure.operator_key, json={"id": tenant_id})
    assert again.status_code == 409
    assert again.get_json()["error"]["code"] == "already_exists"
    assert "api_key" not in again.get_json()
    assert _key_ids(secure, tenant_id) == [key_id]


def test_tenant_admin_cannot_create_tenants(secure: SecureApp) -> None:
    _, admin_key, _ = _tenant(secure)
    new_id = f"roles-{secrets.token_hex(4)}"
    r = secure.call("POST", TENANTS, admin_key, json={"id": new_id})
    assert r.status_code == 403
    assert "operator" in _error(r)
    assert _key_ids(secure, new_id) == []


def test_tenant_admin_cannot_mint_a_key_of_an_existing_tenant(secure: SecureApp) -> None:
    victim, _, victim_key_id = _tenant(secure, "victim")
    _, attacker_key, _ = _tenant(secure, "attacker")
    via_tenants = secure.call("POST", TENANTS, attacker_key, json={"id": victim})
    via_keys = secure.call("POST", KEYS, attacker_key, json={"tenant_id": victim, "role": "admin"})
    assert via_tenants.status_code == 403 and "api_key" not in via_tenants.get_json()
    assert via_keys.status_code == 403 and "api_key" not in via_keys.get_json()
    assert _key_ids(secure, victim) == [victim_key_id]


def test_tenant_admin_cannot_list_another_tenants_keys(secure: SecureApp) -> None:
    other, _, _ = _tenant(secure)
    _, admin_key, _ = _tenant(secure)
    r = secure.call("GET", f"{KEYS}?tenant_id={other}", admin_key)
    assert r.status_code == 403
    assert "own tenant" in _error(r)


def test_another_tenants_key_id_answers_like_a_missing_one(secure: SecureApp) -> None:
    _, _, other_key_id = _tenant(secure)
    _, admin_key, _ = _tenant(secure)
    missing_id = "key-" + secrets.token_hex(8)
    for method, template in (("GET", "{}/{}"), ("POST", "{}/{}/revoke")):
        foreign = secure.call(method, template.format(KEYS, other_key_id), admin_key)
        missing = secure.call(method, template.format(KEYS, missing_id), admin_key)
        assert foreign.status_code == missing.status_code == 404
        assert _error(foreign).replace(other_key_id, "ID") == _error(missing).replace(
            missing_id, "ID"
        )
    with secure.engine.connect() as conn:
        revoked_at = conn.execute(
            sa.text("SELECT revoked_at FROM api_keys WHERE id = :k"), {"k": other_key_id}
        ).scalar_one()
    assert revoked_at is None


def test_tenant_admin_cannot_reach_another_tenants_objects(secure: SecureApp) -> None:
    secure.keep_worker_alive()
    _, owner_key, _ = _tenant(secure)
    _, admin_key, _ = _tenant(secure)
    session = secure.call("POST", "/api/v1/create_session", owner_key, json={"tags": []})
    model = secure.call(
        "POST",
        "/api/v1/create_model",
        owner_key,
        json={
            "session_id": session.get_json()["session_id"],
            "model_seq_id": 0,
            "base_model": "treadle/tiny-debug",
            "lora_config": {"rank": 4},
        },
    )
    assert model.status_code == 200, model.get_data(as_text=True)
    model_id = model.get_json()["model_id"]
    info = secure.call("POST", "/api/v1/get_info", admin_key, json={"model_id": model_id})
    log = secure.call("GET", f"/api/v1/treadle/sessions/{model_id}/events", admin_key)
    runs = secure.call("GET", "/api/v1/training_runs", admin_key)
    assert info.status_code == log.status_code == 404
    assert model_id not in runs.get_data(as_text=True)


def test_tenant_admin_manages_its_own_tenants_keys(secure: SecureApp) -> None:
    tenant_id, admin_key, admin_key_id = _tenant(secure)
    member_key, member_key_id = _key(secure, admin_key)
    listed = secure.call("GET", KEYS, admin_key).get_json()["keys"]
    assert [k["id"] for k in listed] == [admin_key_id, member_key_id]
    assert {k["tenant_id"] for k in listed} == {tenant_id}
    revoked = secure.call("POST", f"{KEYS}/{member_key_id}/revoke", admin_key)
    assert revoked.status_code == 200
    assert revoked.get_json()["key"]["revoked_by"] == admin_key_id
    assert secure.call("GET", KEYS, member_key).status_code == 401


def test_member_cannot_manage_keys(secure: SecureApp) -> None:
    _, admin_key, admin_key_id = _tenant(secure)
    member_key, _ = _key(secure, admin_key)
    assert secure.call("POST", KEYS, member_key, json={"role": "member"}).status_code == 403
    assert secure.call("GET", KEYS, member_key).status_code == 403
    assert secure.call("GET", f"{KEYS}/{admin_key_id}", member_key).status_code == 403
    refused = secure.call("POST", f"{KEYS}/{admin_key_id}/revoke", member_key)
    assert refused.status_code == 403
    assert "admin" in _error(refused)
    assert secure.call("GET", KEYS, admin_key).status_code == 200


def test_member_reads_and_revokes_its_own_key(secure: SecureApp) -> None:
    _, admin_key, _ = _tenant(secure)
    member_key, member_key_id = _key(secure, admin_key)
    own = secure.call("GET", f"{KEYS}/{member_key_id}", member_key)
    assert own.status_code == 200 and own.get_json()["key"]["role"] == "member"
    assert secure.call("POST", f"{KEYS}/{member_key_id}/revoke", member_key).status_code == 200
    assert secure.call("GET", f"{KEYS}/{member_key_id}", member_key).status_code == 401


def test_tenant_admin_cannot_list_disable_or_enable_tenants(secure: SecureApp) -> None:
    tenant_id, admin_key, _ = _tenant(secure)
    assert secure.call("GET", TENANTS, admin_key).status_code == 403
    assert secure.call("POST", f"{TENANTS}/{tenant_id}/disable", admin_key).status_code == 403
    assert secure.call("POST", f"{TENANTS}/{tenant_id}/enable", admin_key).status_code == 403
    assert secure.call("GET", KEYS, admin_key).status_code == 200


def test_operator_manages_any_tenants_keys(secure: SecureApp) -> None:
    tenant_id, _, admin_key_id = _tenant(secure)
    created = secure.call(
        "POST", KEYS, secure.operator_key, json={"tenant_id": tenant_id, "role": "member"}
    )
    assert created.status_code == 201
    assert created.get_json()["key"]["tenant_id"] == tenant_id
    listed = secure.call("GET", f"{KEYS}?tenant_id={tenant_id}", secure.operator_key)
    assert [k["id"] for k in listed.get_json()["keys"]] == [
        admin_key_id,
        created.get_json()["key"]["id"],
    ]
    revoked = secure.call("POST", f"{KEYS}/{admin_key_id}/revoke", secure.operator_key)
    assert revoked.status_code == 200 and revoked.get_json()["key"]["revoked_at"] is not None


def _operator_keys(secure: SecureApp) -> int:
    with secure.engine.connect() as conn:
        query = sa.text("SELECT count(*) FROM api_keys WHERE role = 'operator'")
        return int(conn.execute(query).scalar_one())


def test_operator_cannot_mint_operator_keys(secure: SecureApp) -> None:
    before = _operator_keys(secure)
    r = secure.call("POST", KEYS, secure.operator_key, json={"role": "operator"})
    assert r.status_code == 400
    assert "TREADLE_ADMIN_KEY" in _error(r)
    assert _operator_keys(secure) == before


def test_the_last_operator_key_cannot_be_revoked(secure: SecureApp) -> None:
    with secure.engine.connect() as conn:
        live = conn.execute(
            sa.text("SELECT id FROM api_keys WHERE role = 'operator' AND revoked_at IS NULL")
        ).scalars()
        (operator_key_id,) = list(live)  # precondition: otherwise this test would revoke it
    r = secure.call("POST", f"{KEYS}/{operator_key_id}/revoke", secure.operator_key)
    assert r.status_code == 409
    assert "last operator key" in _error(r) and "TREADLE_ADMIN_KEY" in _error(r)
    assert secure.call("GET", TENANTS, secure.operator_key).status_code == 200


def test_an_admin_of_the_operators_tenant_cannot_revoke_the_operator_key(
    secure: SecureApp,
) -> None:
    created = secure.call(
        "POST", KEYS, secure.operator_key, json={"tenant_id": "default", "role": "admin"}
    )
    default_admin = created.get_json()["api_key"]
    listed = secure.call("GET", KEYS, default_admin).get_json()["keys"]
    operator_key_id = next(k["id"] for k in listed if k["role"] == "operator")
    r = secure.call("POST", f"{KEYS}/{operator_key_id}/revoke", default_admin)
    assert r.status_code == 403
    assert secure.call("GET", TENANTS, secure.operator_key).status_code == 200


def test_the_operators_own_tenant_cannot_be_disabled(secure: SecureApp) -> None:
    r = secure.call("POST", f"{TENANTS}/default/disable", secure.operator_key)
    assert r.status_code == 409
    assert "operator" in _error(r)
    assert secure.call("GET", TENANTS, secure.operator_key).status_code == 200
