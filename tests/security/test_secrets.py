"""No key's text, nor its secret part, is stored or logged: after tenants, keys, operations,
a revocation, a disabled tenant and refused keys, a dump of every row of every table, every log
record (DEBUG, SQLAlchemy's statements and parameters included) and every file the platform
wrote hold none of them."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.secure_app import SecureApp

pytestmark = pytest.mark.integration

TENANTS = "/api/v1/treadle/tenants"
KEYS = "/api/v1/treadle/keys"


def _dump_tables(engine: sa.Engine) -> str:
    """Every row of every table of the database, as text."""
    with engine.connect() as conn:
        names = conn.execute(
            sa.text(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = 'public' AND table_type = 'BASE TABLE'"
            )
        ).scalars()
        rows = [
            row
            for name in list(names)
            for row in conn.execute(sa.text(f'SELECT t::text FROM "{name}" AS t')).scalars()
        ]
    assert any("operator" in r for r in rows)  # the dump does reach api_keys
    return "\n".join(rows)


def _dump_files(root: Path) -> bytes:
    return b"\n".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def _secrets_of(keys: list[str]) -> list[str]:
    """Each key's text and, for a minted key (`tml-<public id>-<secret>`), its secret part."""
    found = list(keys)
    for key in keys:
        _, _, rest = key.partition("tml-")
        _, _, secret = rest.partition("-")
        found.append(secret)
    assert all(len(s) >= 16 for s in found)
    return found


def test_no_key_text_or_secret_is_stored_or_logged(
    secure: SecureApp, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="sqlalchemy")  # its own default is WARNING
    secure.keep_worker_alive()
    call = secure.call
    tenant_id = f"secrets-{secrets.token_hex(4)}"
    created = call("POST", TENANTS, secure.operator_key, json={"id": tenant_id}).get_json()
    admin_key = created["api_key"]
    minted = call("POST", KEYS, admin_key, json={"role": "member"}).get_json()
    member_key, member_key_id = minted["api_key"], minted["key"]["id"]
    second = call("POST", KEYS, secure.operator_key, json={"tenant_id": tenant_id, "role": "admin"})
    second_admin_key = second.get_json()["api_key"]

    session = call("POST", "/api/v1/create_session", member_key, json={"tags": []}).get_json()
    model = call(
        "POST",
        "/api/v1/create_model",
        member_key,
        json={
            "session_id": session["session_id"],
            "model_seq_id": 0,
            "base_model": "treadle/tiny-debug",
            "lora_config": {"rank": 4},
        },
    ).get_json()
    call(
        "POST", "/api/v1/optim_step", member_key, json={"model_id": model["model_id"], "seq_id": 1}
    )
    call("POST", "/api/v1/retrieve_future", member_key, json={"request_id": model["request_id"]})
    call("POST", f"/api/v1/treadle/sessions/{model['model_id']}/stop", member_key)
    wrong_secret = member_key.rsplit("-", 1)[0] + "-" + secrets.token_urlsafe(32)
    assert call("GET", KEYS, wrong_secret).status_code == 401
    call("POST", f"{KEYS}/{member_key_id}/revoke", admin_key)
    assert call("GET", "/api/v1/treadle/base_models", member_key).status_code == 401
    call("POST", f"{TENANTS}/{tenant_id}/disable", secure.operator_key)
    assert call("GET", KEYS, second_admin_key).status_code == 403

    keys = [secure.operator_key, admin_key, member_key, second_admin_key, wrong_secret]
    tables = _dump_tables(secure.engine)
    logged = "\n".join(
        f"{r.name} {r.levelname} {r.getMessage()} {r.args!r} {r.exc_text or ''}"
        for r in caplog.records
    )
    assert "api_keys" in logged  # SQLAlchemy's statements were captured
    files = _dump_files(secure.data_dir)
    for secret in _secrets_of(keys):
        assert secret not in tables
        assert secret not in logged
        assert secret.encode() not in files
