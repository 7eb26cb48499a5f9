"""Tenant and key management under /api/v1/treadle: the operator creates, lists, disables and
enables tenants; tenant admins (and the operator, for any tenant) create, list and revoke keys,
a key optionally with an AWS-style access key pair for SigV4 (`"aws": true`).

Views parse, call `platform.tenants` / `platform.keys` (where the role checks live) and
serialise; a key's text (and an access key pair's secret) appears only in the answer that minted
it (never cached by a proxy).
After a revocation or a disabled tenant, this process's authentication cache is evicted at once.
Imports platform only; never torch.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime
from typing import Any

from flask import Blueprint, Response, jsonify, request

from treadle.api import auth
from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.treadle.schemas_admin import CreateKey, CreateTenant
from treadle.platform.tenancy import access_keys, keys, tenants

bp = Blueprint("admin", __name__, url_prefix="/api/v1/treadle")


@bp.post("/tenants")
def create_tenant() -> Any:
    body = parse(CreateTenant, json_body())
    with services().db.begin() as conn:
        created = keys.open_tenant(conn, principal(), body.id, body.name)
    return _minted(
        {
            "tenant": _tenant(created.tenant),
            "key": _key(created.admin.key),
            "api_key": created.admin.plaintext,
        }
    )


@bp.get("/tenants")
def list_tenants() -> Any:
    with services().db.connect() as conn:
        found = tenants.list_tenants(conn, principal())
    return jsonify(tenants=[_tenant(t) for t in found])


@bp.post("/tenants/<tenant_id>/disable")
def disable_tenant(tenant_id: str) -> Any:
    with services().db.begin() as conn:
        tenant = tenants.set_disabled(conn, principal(), tenant_id, True)
    auth.forget_tenant(tenant_id)
    return jsonify(tenant=_tenant(tenant))


@bp.post("/tenants/<tenant_id>/enable")
def enable_tenant(tenant_id: str) -> Any:
    with services().db.begin() as conn:
        tenant = tenants.set_disabled(conn, principal(), tenant_id, False)
    return jsonify(tenant=_tenant(tenant))


@bp.post("/keys")
def create_key() -> Any:
    body = parse(CreateKey, json_body())
    if body.aws:
        keyring = auth.authenticator().keyring
        with services().db.begin() as conn:
            pair = access_keys.create_access_key(
                conn, principal(), keyring, body.tenant_id, body.role, body.name
            )
        return _minted(
            {
                "key": _key(pair.key),
                "api_key": pair.plaintext,
                "access_key_id": pair.access_key_id,
                "secret_access_key": pair.secret_access_key,
            }
        )
    with services().db.begin() as conn:
        new = keys.create_key(conn, principal(), body.tenant_id, body.role, body.name)
    return _minted({"key": _key(new.key), "api_key": new.plaintext})


@bp.get("/keys")
def list_keys() -> Any:
    tenant_id = request.args.get("tenant_id") or None
    with services().db.connect() as conn:
        found = keys.list_keys(conn, principal(), tenant_id)
    return jsonify(keys=[_key(k) for k in found])


@bp.get("/keys/<key_id>")
def get_key(key_id: str) -> Any:
    with services().db.connect() as conn:
        key = keys.get_key(conn, principal(), key_id)
    return jsonify(key=_key(key))


@bp.post("/keys/<key_id>/revoke")
def revoke_key(key_id: str) -> Any:
    with services().db.begin() as conn:
        key = keys.revoke_key(conn, principal(), key_id)
    auth.forget_key(key_id)
    return jsonify(key=_key(key))


def _minted(body: dict[str, Any]) -> Response:
    """201 with a freshly minted key: shown once, so no cache may keep it."""
    response = jsonify(body)
    response.status_code = 201
    response.headers["Cache-Control"] = "no-store"
    return response


def _tenant(tenant: tenants.Tenant) -> dict[str, Any]:
    return {k: _json(v) for k, v in asdict(tenant).items()}


def _key(key: keys.ApiKey) -> dict[str, Any]:
    """A key's record; `access_key_id` only for a key that has one."""
    record = {k: _json(v) for k, v in asdict(key).items()}
    if record["access_key_id"] is None:
        del record["access_key_id"]
    return record


def _json(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value
