"""The rest of the Tinker surface the pinned SDK and CLI can call, tenant-scoped:

- `PUT /api/v1/sessions/<id>/project`: Treadle's only project is the caller's tenant (project_id
  = tenant id, docs/api.md), so a client session is always in it: that id is accepted, any other
  is a 400 that says so.
- `POST /api/v1/join_sampling_session`: the next clone number of a sampling session.
- `GET|DELETE /api/v1/auth/apikey/me` (`tinker auth login` / `logout`): the presented key's
  public metadata, or its revocation (an operator key is revoked with `treadle keys` only).
- `POST /api/v1/auth/token`: refused with a 400 that says what to do instead; the SDK sends
  none while POST /api/v1/client/config leaves `pjwt_auth_enabled` off, as Treadle's does.

Views parse, call the platform, serialise. Imports platform only; never torch.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify

from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.tinker.schemas_extras import AssignProject, JoinSamplingSession
from treadle.platform.errors import PermissionDeniedError, ValidationError
from treadle.platform.operations import futures
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.tenancy import keys
from treadle.platform.tenancy.tenants import Role

bp = Blueprint("tinker_extras", __name__, url_prefix="/api/v1")


@bp.put("/sessions/<session_id>/project")
def assign_session_project(session_id: str) -> Any:
    body = parse(AssignProject, json_body())
    who = principal()
    with services().db.connect() as conn:
        sessions_core.get_client_session(conn, who, session_id)  # another tenant's: 404
    if body.project_id != who.tenant_id:
        raise ValidationError(
            f"project {body.project_id!r} does not exist here: Treadle has one project per "
            f"tenant, named by the tenant id, and session {session_id} is in {who.tenant_id!r} "
            f"already; pass project_id={who.tenant_id!r} (or leave the session where it is)"
        )
    return jsonify(session_id=session_id, project_id=who.tenant_id)


@bp.post("/join_sampling_session")
def join_sampling_session() -> Any:
    body = parse(JoinSamplingSession, json_body())
    with services().db.begin() as conn:
        number = futures.join(conn, principal(), body.sampling_session_id)
    return jsonify(type="join_sampling_session", client_counter=number)


@bp.get("/auth/apikey/me")
def api_key_me() -> Any:
    who = principal()
    with services().db.connect() as conn:
        key = keys.get_key(conn, who, who.key_id)
    # The CLI stores the key under an integer id: the key id's hex part, read as a number.
    number = int(key.id.removeprefix("key-"), 16)
    return jsonify(
        key_id=number,
        name=key.name or key.id,
        note=f"Treadle key {key.id} ({key.role}) of tenant {key.tenant_id}",
        details={
            "org_details": {"name": key.tenant_id},
            # Treadle keeps no e-mail addresses: the key id stands for the holder.
            "user_details": {"email": key.id},
        },
    )


@bp.delete("/auth/apikey/me")
def delete_api_key_me() -> Any:
    who = principal()
    if who.role == Role.OPERATOR:
        raise PermissionDeniedError(
            "an operator key is not revoked through the Tinker logout route; revoke it with "
            "`treadle keys revoke <key id>` once another operator key exists"
        )
    with services().db.begin() as conn:
        key = keys.revoke_key(conn, who, who.key_id)
    return jsonify(key_id=key.id, revoked=True)


@bp.post("/auth/token")
def auth_token() -> Any:
    raise ValidationError(
        "Treadle exchanges no keys for JWTs (POST /api/v1/client/config answers "
        "pjwt_auth_enabled=false): send your tml- key as X-API-Key on every request"
    )
