"""Access key pairs (SigV4) on API keys, against a real PostgreSQL: what minting stores (no
plaintext secret; a ciphertext only the configured key opens), who may mint, what listings show,
revocation and disabled tenants refusing the next signed request, rotation of
TREADLE_SECRETS_KEY, no secret in any log, and `treadle keys create --aws` printing exactly the
two export lines."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from cryptography.fernet import Fernet, InvalidToken
from flask import Flask
from werkzeug.exceptions import RequestEntityTooLarge

from tests.conftest import Platform
from tests.secure_app import SecureApp
from treadle.api.app import create_app
from treadle.api.auth import Authenticator
from treadle.api.sagemaker import sigv4
from treadle.platform import db
from treadle.platform.errors import AuthenticationError, PermissionDeniedError
from treadle.platform.tenancy import access_keys

pytestmark = pytest.mark.integration

TENANTS = "/api/v1/treadle/tenants"
KEYS = "/api/v1/treadle/keys"
OLD_KEY = Fernet.generate_key().decode()
NEW_KEY = Fernet.generate_key().decode()


@pytest.fixture(scope="module")
def aws_app(secure: SecureApp) -> Iterator[Flask]:
    """A second API process on the security tests' database, with TREADLE_SECRETS_KEY set."""
    app = create_app(replace(secure.app.extensions["treadle"].config, secrets_key=OLD_KEY))
    yield app
    app.extensions["treadle"].close()


def call(app: Flask, method: str, path: str, key: str, **kwargs: Any) -> Any:
    return app.test_client().open(path, method=method, headers={"X-API-Key": key}, **kwargs)


def tenant(app: Flask, secure: SecureApp) -> tuple[str, str]:
    """A new tenant: (its id, its admin key)."""
    tenant_id = f"aws-{secrets.token_hex(4)}"
    r = call(app, "POST", TENANTS, secure.operator_key, json={"id": tenant_id})
    assert r.status_code == 201, r.get_data(as_text=True)
    return tenant_id, r.get_json()["api_key"]


def mint(app: Flask, key: str, **body: Any) -> dict[str, Any]:
    r = call(app, "POST", KEYS, key, json={"aws": True, **body})
    assert r.status_code == 201, r.get_data(as_text=True)
    return r.get_json()  # type: ignore[no-any-return]


def authenticator(app: Flask) -> Authenticator:
    return app.extensions["treadle.auth"]  # type: ignore[no-any-return]


def signed(
    app: Flask, access_key_id: str, secret: str, region: str = "us-west-2", body: bytes = b""
) -> Any:
    """A json 1.1 request signed by botocore, checked by the SageMaker surface's one call."""
    body = body or json.dumps({"TrainingSessionName": "run-1"}).encode()
    headers = {
        "X-Amz-Target": "SageMaker.DescribeTrainingSession",
        "Content-Type": "application/x-amz-json-1.1",
    }
    request = AWSRequest(method="POST", url="http://localhost/", data=body, headers=headers)
    SigV4Auth(Credentials(access_key_id, secret), "sagemaker", region).add_auth(request)
    sent = {k: str(v) for k, v in request.headers.items()}
    with app.test_request_context("/", method="POST", headers=sent, data=body):
        return sigv4.authenticate()


def row(secure: SecureApp, key_id: str) -> Any:
    with secure.engine.connect() as conn:
        return conn.execute(sa.text("SELECT * FROM api_keys WHERE id = :k"), {"k": key_id}).one()


def test_a_mint_gives_the_api_key_and_an_aws_shaped_pair(aws_app: Flask, secure: SecureApp) -> None:
    _, admin_key = tenant(aws_app, secure)
    minted = mint(aws_app, admin_key, role="member", name="sagemaker")
    assert re.fullmatch(r"[A-Z0-9]{20}", minted["access_key_id"])
    assert re.fullmatch(r"[A-Za-z0-9]{40}", minted["secret_access_key"])
    assert minted["key"]["access_key_id"] == minted["access_key_id"]
    assert minted["api_key"].startswith("tml-")
    # the same key through X-API-Key
    me = call(aws_app, "GET", f"{KEYS}/{minted['key']['id']}", minted["api_key"])
    assert me.status_code == 200 and me.get_json()["key"]["role"] == "member"


def test_the_row_holds_no_plaintext_secret_and_only_the_configured_key_opens_it(
    aws_app: Flask, secure: SecureApp
) -> None:
    _, admin_key = tenant(aws_app, secure)
    minted = mint(aws_app, admin_key)
    stored = row(secure, minted["key"]["id"])
    assert minted["secret_access_key"] not in repr(tuple(stored))
    assert stored.access_key_id == minted["access_key_id"]
    opened = Fernet(OLD_KEY.encode()).decrypt(stored.secret_ciphertext.encode()).decode()
    assert opened == minted["secret_access_key"]
    with pytest.raises(InvalidToken):
        Fernet(NEW_KEY.encode()).decrypt(stored.secret_ciphertext.encode())


def test_a_signed_request_yields_the_keys_principal_and_the_scopes_region(
    aws_app: Flask, secure: SecureApp
) -> None:
    tenant_id, admin_key = tenant(aws_app, secure)
    minted = mint(aws_app, admin_key)
    found = signed(aws_app, minted["access_key_id"], minted["secret_access_key"], "eu-central-1")
    assert (found.principal.key_id, found.principal.tenant_id) == (minted["key"]["id"], tenant_id)
    assert found.principal.role == "member" and found.region == "eu-central-1"
    assert row(secure, minted["key"]["id"]).last_used_at is not None
    with pytest.raises(sigv4.SigV4Error) as refused:
        signed(aws_app, minted["access_key_id"], minted["secret_access_key"][::-1])
    assert refused.value.aws_code == "InvalidSignatureException"


def test_a_revoked_keys_access_key_is_refused_on_its_next_signed_request(
    aws_app: Flask, secure: SecureApp
) -> None:
    _, admin_key = tenant(aws_app, secure)
    minted = mint(aws_app, admin_key)
    pair = (minted["access_key_id"], minted["secret_access_key"])
    signed(aws_app, *pair)  # and now cached in this process
    revoked = call(aws_app, "POST", f"{KEYS}/{minted['key']['id']}/revoke", admin_key)
    assert revoked.status_code == 200
    with pytest.raises(sigv4.SigV4Error) as refused:
        signed(aws_app, *pair)
    assert refused.value.aws_code == "UnrecognizedClientException"
    assert "revoked" in refused.value.message
    with pytest.raises(AuthenticationError, match="revoked"):
        authenticator(aws_app).signing_key(pair[0])


def test_a_disabled_tenants_access_key_is_access_denied_until_enabled(
    aws_app: Flask, secure: SecureApp
) -> None:
    tenant_id, admin_key = tenant(aws_app, secure)
    minted = mint(aws_app, admin_key)
    pair = (minted["access_key_id"], minted["secret_access_key"])
    signed(aws_app, *pair)
    call(aws_app, "POST", f"{TENANTS}/{tenant_id}/disable", secure.operator_key)
    with pytest.raises(sigv4.SigV4Error) as refused:
        signed(aws_app, *pair)
    assert refused.value.aws_code == "AccessDeniedException"
    assert isinstance(refused.value, PermissionDeniedError)
    call(aws_app, "POST", f"{TENANTS}/{tenant_id}/enable", secure.operator_key)
    assert signed(aws_app, *pair).principal.key_id == minted["key"]["id"]


def test_a_body_over_the_apis_limit_but_within_sagemakers_verifies(
    aws_app: Flask, secure: SecureApp
) -> None:
    """SageMaker's forwardBackward chunks run to 10-12 MB: TREADLE_SAGEMAKER_MAX_BODY_BYTES
    (16 MiB), not TREADLE_MAX_BODY_BYTES (8 MiB), bounds them; beyond it werkzeug's 413."""
    config = aws_app.extensions["treadle"].config
    assert config.max_body_bytes < 12_000_000 < config.sagemaker_max_body_bytes
    _, admin_key = tenant(aws_app, secure)
    minted = mint(aws_app, admin_key)
    pair = (minted["access_key_id"], minted["secret_access_key"])
    big = b'{"x": "' + b"a" * 12_000_000 + b'"}'
    assert signed(aws_app, *pair, body=big).principal.key_id == minted["key"]["id"]
    with pytest.raises(RequestEntityTooLarge):
        signed(aws_app, *pair, body=b"a" * (config.sagemaker_max_body_bytes + 1))


def test_an_unknown_access_key_id_is_unrecognized(aws_app: Flask) -> None:
    with pytest.raises(sigv4.SigV4Error) as refused:
        signed(aws_app, "TRDL" + "Z" * 16, "y" * 40)
    assert refused.value.aws_code == "UnrecognizedClientException"


def test_only_a_tenants_admin_or_the_operator_mints(aws_app: Flask, secure: SecureApp) -> None:
    tenant_a, admin_a = tenant(aws_app, secure)
    tenant_b, _ = tenant(aws_app, secure)
    member_a = mint(aws_app, admin_a)["api_key"]
    for key, target in ((member_a, tenant_a), (member_a, tenant_b), (admin_a, tenant_b)):
        r = call(aws_app, "POST", KEYS, key, json={"aws": True, "tenant_id": target})
        assert r.status_code == 403, (target, r.get_data(as_text=True))
        assert "secret_access_key" not in r.get_data(as_text=True)
    minted = mint(aws_app, secure.operator_key, tenant_id=tenant_b)
    assert minted["key"]["tenant_id"] == tenant_b


def test_a_disabled_tenant_gets_no_new_pair(aws_app: Flask, secure: SecureApp) -> None:
    tenant_id, _ = tenant(aws_app, secure)
    call(aws_app, "POST", f"{TENANTS}/{tenant_id}/disable", secure.operator_key)
    r = call(aws_app, "POST", KEYS, secure.operator_key, json={"aws": True, "tenant_id": tenant_id})
    assert r.status_code == 409 and "disabled" in r.get_json()["error"]["message"]


def test_listing_shows_the_access_key_id_never_the_secret(
    aws_app: Flask, secure: SecureApp
) -> None:
    _, admin_key = tenant(aws_app, secure)
    minted = mint(aws_app, admin_key)
    listed = call(aws_app, "GET", KEYS, admin_key).get_json()["keys"]
    by_id = {k["id"]: k for k in listed}
    assert by_id[minted["key"]["id"]]["access_key_id"] == minted["access_key_id"]
    assert [k for k in listed if "access_key_id" not in k]  # the admin key has no pair
    text = json.dumps(listed)
    ciphertext = row(secure, minted["key"]["id"]).secret_ciphertext
    assert minted["secret_access_key"] not in text and ciphertext not in text
    one = call(aws_app, "GET", f"{KEYS}/{minted['key']['id']}", admin_key).get_json()["key"]
    assert one["access_key_id"] == minted["access_key_id"]
    assert minted["secret_access_key"] not in json.dumps(one)


def test_no_secret_is_logged_while_minting_verifying_and_revoking(
    aws_app: Flask, secure: SecureApp, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="sqlalchemy")
    _, admin_key = tenant(aws_app, secure)
    minted = mint(aws_app, admin_key)
    pair = (minted["access_key_id"], minted["secret_access_key"])
    signed(aws_app, *pair)
    with pytest.raises(sigv4.SigV4Error):
        signed(aws_app, pair[0], pair[1][::-1])
    call(aws_app, "POST", f"{KEYS}/{minted['key']['id']}/revoke", admin_key)
    with pytest.raises(sigv4.SigV4Error):
        signed(aws_app, *pair)
    logged = "\n".join(
        f"{r.name} {r.levelname} {r.getMessage()} {r.args!r} {r.exc_text or ''}"
        for r in caplog.records
    )
    assert "api_keys" in logged and pair[0] in logged  # the capture did reach them
    assert pair[1] not in logged
    assert pair[1] not in repr(authenticator(aws_app).signing_keys._entries)


def test_a_secret_under_the_old_key_decrypts_after_rotation(
    aws_app: Flask, secure: SecureApp
) -> None:
    _, admin_key = tenant(aws_app, secure)
    minted = mint(aws_app, admin_key)  # encrypted under OLD_KEY
    pair = (minted["access_key_id"], minted["secret_access_key"])
    config = secure.app.extensions["treadle"].config
    rotated = create_app(replace(config, secrets_key=f"{NEW_KEY},{OLD_KEY}"))
    only_new = create_app(replace(config, secrets_key=NEW_KEY))
    try:
        assert signed(rotated, *pair).principal.key_id == minted["key"]["id"]
        fresh = mint(rotated, admin_key)  # encrypted under NEW_KEY, the first
        ciphertext = row(secure, fresh["key"]["id"]).secret_ciphertext.encode()
        assert Fernet(NEW_KEY.encode()).decrypt(ciphertext).decode() == fresh["secret_access_key"]
        with pytest.raises(sigv4.SigV4Error) as refused:
            signed(only_new, *pair)
        assert "TREADLE_SECRETS_KEY" in refused.value.message
        assert pair[1] not in refused.value.message
    finally:
        rotated.extensions["treadle"].close()
        only_new.extensions["treadle"].close()


def test_without_a_secrets_key_minting_is_a_409_saying_how_to_set_it(secure: SecureApp) -> None:
    app = create_app(replace(secure.app.extensions["treadle"].config, secrets_key=""))
    try:
        r = call(app, "POST", KEYS, secure.operator_key, json={"aws": True})
        assert r.status_code == 409
        message = r.get_json()["error"]["message"]
        assert "TREADLE_SECRETS_KEY" in message and "urlsafe_b64encode" in message
        with pytest.raises(sigv4.SigV4Error) as refused:
            signed(app, "TRDL" + "A" * 16, "s" * 40)
        assert "TREADLE_SECRETS_KEY" in refused.value.message
    finally:
        app.extensions["treadle"].close()


def test_keyring_refuses_to_open_what_another_key_sealed() -> None:
    sealed = access_keys.Keyring(OLD_KEY).encrypt("the-secret")
    assert access_keys.Keyring(f"{NEW_KEY}, {OLD_KEY}").decrypt(sealed, "TRDLX") == "the-secret"
    with pytest.raises(access_keys.SecretsKeyError, match="cannot be decrypted"):
        access_keys.Keyring(NEW_KEY).decrypt(sealed, "TRDLX")
    assert "the-secret" not in repr(access_keys.Keyring(OLD_KEY))


def test_cli_create_aws_prints_exactly_the_two_export_lines(platform: Platform) -> None:
    tenant_id = f"cli-aws-{secrets.token_hex(3)}"
    env = {
        **os.environ,
        "TREADLE_BASE_URL": platform.base_url,
        "TREADLE_API_KEY": platform.admin_key,
    }

    def treadle(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "treadle.cli", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert treadle("tenants", "create", tenant_id).returncode == 0
    done = treadle("keys", "create", "--tenant", tenant_id, "--aws")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and done.stdout.endswith("\n"), done.stdout
    assert re.fullmatch(r"AWS_ACCESS_KEY_ID=[A-Z0-9]{20}", lines[0])
    assert re.fullmatch(r"AWS_SECRET_ACCESS_KEY=[A-Za-z0-9]{40}", lines[1])
    access_key_id, secret = (line.split("=", 1)[1] for line in lines)
    # `treadle up` made a secrets key (mode 600) and its API encrypted the secret under it
    key_file = platform.data_dir / "secrets_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    keyring = access_keys.Keyring(key_file.read_text().strip())
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.begin() as conn:
            principal, opened = access_keys.signing_key(conn, keyring, access_key_id)
    finally:
        engine.dispose()
    assert opened == secret and principal.tenant_id == tenant_id
    listed = treadle("keys", "list", "--tenant", tenant_id)
    assert access_key_id in listed.stdout and secret not in listed.stdout
