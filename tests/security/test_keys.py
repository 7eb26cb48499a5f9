"""API keys: their shape, what is stored and listed, revocation and disabled tenants taking
effect on the next request (in this API process at once, in another within about a second),
keys from before roles existed, and the `treadle tenants` / `treadle keys` commands."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from typing import Any

import pytest
import sqlalchemy as sa

from tests.conftest import Platform
from tests.secure_app import SecureApp
from treadle.api.app import create_app
from treadle.api.context import Services
from treadle.cli import main as cli
from treadle.platform.errors import AuthenticationError
from treadle.platform.tenancy import keys, tenants

pytestmark = pytest.mark.integration

TENANTS = "/api/v1/treadle/tenants"
KEYS = "/api/v1/treadle/keys"


def _tenant(secure: SecureApp) -> tuple[str, str, str]:
    """A new tenant through the operator: (tenant id, its admin key, that key's id)."""
    tenant_id = f"keys-{secrets.token_hex(4)}"
    r = secure.call("POST", TENANTS, secure.operator_key, json={"id": tenant_id})
    assert r.status_code == 201, r.get_data(as_text=True)
    return tenant_id, r.get_json()["api_key"], r.get_json()["key"]["id"]


def _member(secure: SecureApp, admin_key: str) -> tuple[str, str]:
    r = secure.call("POST", KEYS, admin_key, json={"role": "member", "name": "ci"})
    assert r.status_code == 201, r.get_data(as_text=True)
    return r.get_json()["api_key"], r.get_json()["key"]["id"]


def _row(secure: SecureApp, key_id: str) -> sa.Row[tuple[object, ...]]:
    with secure.engine.connect() as conn:
        query = sa.text("SELECT * FROM api_keys WHERE id = :k")
        return conn.execute(query, {"k": key_id}).one()


def test_a_key_is_tml_its_public_id_and_a_32_byte_secret(secure: SecureApp) -> None:
    _, admin_key, key_id = _tenant(secure)
    match = re.fullmatch(r"tml-([0-9a-f]{16})-([A-Za-z0-9_-]+)", admin_key)
    assert match is not None
    assert key_id == "key-" + match.group(1)
    assert len(match.group(2)) >= 43  # 32 bytes, urlsafe base64 without padding


def test_only_the_keys_sha256_is_stored(secure: SecureApp) -> None:
    _, admin_key, key_id = _tenant(secure)
    row = _row(secure, key_id)
    assert row.secret_hash == hashlib.sha256(admin_key.encode()).hexdigest()
    secret = admin_key.split("-", 2)[2]  # tml-<id>-<secret>; the secret may itself hold "-"
    assert len(secret) >= 43 and secret not in repr(tuple(row))


def test_listing_shows_id_role_created_last_used_revoked_and_never_the_hash(
    secure: SecureApp,
) -> None:
    _, admin_key, key_id = _tenant(secure)
    listed = secure.call("GET", KEYS, admin_key).get_json()["keys"]
    assert [k["id"] for k in listed] == [key_id]
    assert set(listed[0]) == {
        "id", "tenant_id", "role", "name", "created_at", "created_by",
        "last_used_at", "revoked_at", "revoked_by",
    }  # fmt: skip
    assert admin_key not in json.dumps(listed)
    assert _row(secure, key_id).secret_hash not in json.dumps(listed)


def test_a_request_records_when_the_key_was_last_used(secure: SecureApp) -> None:
    _, admin_key, _ = _tenant(secure)
    member_key, member_key_id = _member(secure, admin_key)
    assert _row(secure, member_key_id).last_used_at is None
    assert secure.call("GET", "/api/v1/treadle/base_models", member_key).status_code == 200
    assert _row(secure, member_key_id).last_used_at is not None


def test_a_revoked_key_is_refused_on_its_next_request(secure: SecureApp) -> None:
    _, admin_key, _ = _tenant(secure)
    member_key, member_key_id = _member(secure, admin_key)
    assert secure.call("GET", "/api/v1/treadle/base_models", member_key).status_code == 200
    assert secure.call("POST", f"{KEYS}/{member_key_id}/revoke", admin_key).status_code == 200
    refused = secure.call("GET", "/api/v1/treadle/base_models", member_key)
    assert refused.status_code == 401
    assert "revoked" in refused.get_json()["error"]["message"]


def test_a_revoked_key_cannot_retrieve_a_future_it_submitted(secure: SecureApp) -> None:
    secure.keep_worker_alive()
    _, admin_key, _ = _tenant(secure)
    member_key, member_key_id = _member(secure, admin_key)
    session = secure.call("POST", "/api/v1/create_session", member_key, json={"tags": []})
    future = secure.call(
        "POST",
        "/api/v1/create_model",
        member_key,
        json={
            "session_id": session.get_json()["session_id"],
            "model_seq_id": 0,
            "base_model": "treadle/tiny-debug",
            "lora_config": {"rank": 4},
        },
    )
    request_id = future.get_json()["request_id"]
    poll = {"request_id": request_id}
    # accepted: its result (200) or, while no worker has run it yet, the SDK's quiet re-poll
    accepted = secure.call("POST", "/api/v1/retrieve_future", member_key, json=poll)
    assert accepted.status_code in (200, 408), accepted.get_data(as_text=True)
    if accepted.status_code == 408:
        assert accepted.get_json()["type"] == "try_again"
    secure.call("POST", f"{KEYS}/{member_key_id}/revoke", admin_key)
    assert secure.call("POST", "/api/v1/retrieve_future", member_key, json=poll).status_code == 401


def test_a_disabled_tenants_keys_are_refused_with_403_until_enabled(secure: SecureApp) -> None:
    tenant_id, admin_key, _ = _tenant(secure)
    assert secure.call("GET", KEYS, admin_key).status_code == 200
    disabled = secure.call("POST", f"{TENANTS}/{tenant_id}/disable", secure.operator_key)
    assert disabled.get_json()["tenant"]["disabled_at"] is not None
    refused = secure.call("GET", KEYS, admin_key)
    assert refused.status_code == 403
    assert f"tenant {tenant_id} is disabled" in refused.get_json()["error"]["message"]
    secure.call("POST", f"{TENANTS}/{tenant_id}/enable", secure.operator_key)
    assert secure.call("GET", KEYS, admin_key).status_code == 200


def test_a_key_minted_before_roles_existed_still_works(secure: SecureApp) -> None:
    tenant_id, _, _ = _tenant(secure)
    public = secrets.token_hex(6)  # the 12-hex-digit shape of keys minted before migration 0004
    legacy = f"tml-{public}-{secrets.token_urlsafe(24)}"
    with secure.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO api_keys (id, tenant_id, secret_hash, role) "
                "VALUES (:id, :t, :h, 'member')"
            ),
            {"id": f"key-{public}", "t": tenant_id, "h": keys.hash_key(legacy)},
        )
    assert secure.call("GET", "/api/v1/treadle/base_models", legacy).status_code == 200
    wrong_secret = f"tml-{public}-{secrets.token_urlsafe(24)}"
    assert secure.call("GET", "/api/v1/treadle/base_models", wrong_secret).status_code == 401


def test_seeding_makes_an_existing_admin_row_the_operators(secure: SecureApp) -> None:
    plaintext = "tml-seeded-" + secrets.token_hex(8)
    with secure.engine.connect() as conn:  # rolled back: no second operator key survives
        key_id = keys.seed_key(conn, tenants.DEFAULT_TENANT, plaintext, "admin")
        assert keys.authenticate(conn, plaintext).role == "admin"
        assert keys.seed_key(conn, tenants.DEFAULT_TENANT, plaintext, "operator") == key_id
        assert keys.authenticate(conn, plaintext).role == "operator"
        conn.rollback()


def test_seeding_a_revoked_key_again_leaves_it_revoked(secure: SecureApp) -> None:
    plaintext = "tml-seeded-" + secrets.token_hex(8)
    with secure.engine.connect() as conn:  # rolled back: no second operator key survives
        key_id = keys.seed_key(conn, tenants.DEFAULT_TENANT, plaintext, "operator")
        conn.execute(sa.text("UPDATE api_keys SET revoked_at = now() WHERE id = :k"), {"k": key_id})
        keys.seed_key(conn, tenants.DEFAULT_TENANT, plaintext, "operator")
        with pytest.raises(AuthenticationError, match="revoked"):
            keys.authenticate(conn, plaintext)
        conn.rollback()


def test_revocation_reaches_another_api_process_within_about_a_second(secure: SecureApp) -> None:
    svc: Services = secure.app.extensions["treadle"]
    other = create_app(svc.config)  # a second API process on the same database
    try:
        _, admin_key, _ = _tenant(secure)
        member_key, member_key_id = _member(secure, admin_key)
        headers = {"X-API-Key": member_key}
        warm = other.test_client().get(f"{KEYS}/{member_key_id}", headers=headers)
        assert warm.status_code == 200  # and now cached in the other process
        assert secure.call("POST", f"{KEYS}/{member_key_id}/revoke", admin_key).status_code == 200
        revoked_at = time.monotonic()
        status = 200
        while status != 401 and time.monotonic() < revoked_at + 3:
            status = other.test_client().get("/api/v1/treadle/base_models", headers=headers)
            status = status.status_code
            time.sleep(0.05)
        assert status == 401
        assert time.monotonic() - revoked_at < 2.5
    finally:
        other.extensions["treadle"].close()


def test_cli_manages_tenants_and_keys_over_http(
    platform: Platform, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base_url, operator_key = platform.base_url, platform.admin_key
    tenant_id = f"cli-{secrets.token_hex(4)}"
    env = {**os.environ, "TREADLE_BASE_URL": base_url, "TREADLE_API_KEY": operator_key}
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "tenants", "create", tenant_id, "--name", "CLI"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    admin_key = json.loads(done.stdout)["api_key"]

    def treadle(key: str, *argv: str) -> tuple[int, Any]:
        monkeypatch.setenv("TREADLE_BASE_URL", base_url)
        monkeypatch.setenv("TREADLE_API_KEY", key)
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, json.loads(out) if code == 0 else err

    code, again = treadle(operator_key, "tenants", "create", tenant_id)
    assert code == 1 and "409" in str(again)
    code, listed = treadle(operator_key, "tenants", "list")
    assert tenant_id in [t["id"] for t in listed]
    code, minted = treadle(admin_key, "keys", "create", "--role", "member")
    member_id = minted["key"]["id"]
    code, own = treadle(admin_key, "keys", "list")
    assert [k["role"] for k in own] == ["admin", "member"]
    code, revoked = treadle(admin_key, "keys", "revoke", member_id)
    assert code == 0 and revoked["revoked_at"] is not None
    code, refused = treadle(admin_key, "tenants", "list")
    assert code == 1 and "403" in str(refused) and "operator" in str(refused)
    code, _ = treadle(operator_key, "tenants", "disable", tenant_id)
    code, disabled = treadle(admin_key, "keys", "list", "--tenant", tenant_id)
    assert code == 1 and "disabled" in str(disabled)
