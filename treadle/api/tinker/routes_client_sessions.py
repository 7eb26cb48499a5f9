"""The Tinker protocol's session routes, so the official SDK's RestClient / AdminClient session
calls and `tinker session export-trace` work against Treadle, tenant-scoped:

- `GET /api/v1/sessions`, `GET /api/v1/sessions/<id>`, `POST /api/v1/sessions/search`: client
  sessions (access_scope / owner "owned"/"own" = opened by the caller's key; "accessible" = the
  caller's tenant's). Another tenant's session answers like a missing one.
- `GET /api/v1/sessions/<id>/trace_export`: a one-hour download link of the session's trace,
  served with no API key by `GET /api/v1/treadle/traces/<token>` (app.PUBLIC_PREFIXES).
- `GET /api/v1/audit`: the tenant's audit log of one UTC day (an admin key's).

Views parse, call the platform, serialise. Imports platform only; never torch.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from flask import Blueprint, Response, jsonify, request, url_for

from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.tinker.schemas_client_sessions import (
    AccessibleOwner,
    ActiveStatus,
    AuditQuery,
    CancelledStatus,
    ClientFinishedStatus,
    FailedStatus,
    ListSessionsQuery,
    OwnOwner,
    SearchSessions,
    SessionQuery,
    StatusQuery,
)
from treadle.platform.audit import audit_log, trace_exports
from treadle.platform.audit import client_session_views as views
from treadle.platform.errors import PermissionDeniedError, ValidationError
from treadle.platform.sessions.sessions import ClientSessionStatus
from treadle.platform.tenancy.tenants import Principal

bp = Blueprint("tinker_sessions", __name__)

# How a client session's status reads in the protocol. Treadle records no finish reason, so a
# finished session reads as a successful finish; an expired one (its client stopped sending
# heartbeats and the platform stopped what it held) as cancelled, since Tinker's "failed" names
# a request, training run or sampler that failed it, and none did.
EXPIRED_DETAIL = "expired: its client sent no heartbeat for too long"
STATUSES: dict[str, dict[str, Any]] = {
    ClientSessionStatus.RUNNING: {"type": "active"},
    ClientSessionStatus.FINISHED: {"type": "client_finished", "reason": {"type": "success"}},
    ClientSessionStatus.EXPIRED: {"type": "cancelled", "detail": EXPIRED_DETAIL},
}
UNKNOWN_OWNER = "unknown"  # a client session opened before Treadle recorded its key


@bp.get("/api/v1/sessions")
def list_sessions() -> Any:
    query = parse(ListSessionsQuery, request.args.to_dict())
    with services().db.connect() as conn:
        ids = views.list_ids(
            conn,
            principal(),
            scope=views.Scope(query.access_scope),
            limit=query.limit,
            offset=query.offset,
        )
    return jsonify(sessions=ids)


@bp.get("/api/v1/sessions/<session_id>")
def get_session(session_id: str) -> Any:
    query = parse(SessionQuery, request.args.to_dict())
    with services().db.connect() as conn:
        found = views.get(conn, principal(), session_id, scope=views.Scope(query.access_scope))
    return jsonify(
        training_run_ids=found.training_run_ids,
        sampler_ids=found.sampler_ids,
        user_metadata=metadata_strings(found.user_metadata),
        display_name=found.display_name,
    )


@bp.post("/api/v1/sessions/search")
def search_sessions() -> Any:
    body = parse(SearchSessions, json_body())
    who = principal()
    query = _search(body, who)
    with services().db.connect() as conn:
        found, more = views.search(conn, who, query)
    cursor = None
    if more and found:
        cursor = {"last_created_at": _time(found[-1].created_at), "last_session_id": found[-1].id}
    return jsonify(sessions=[_summary(s) for s in found], next_cursor=cursor)


@bp.get("/api/v1/sessions/<session_id>/trace_export")
def trace_export(session_id: str) -> Any:
    with services().db.begin() as conn:
        token = trace_exports.issue(conn, principal(), session_id)
    url = url_for("tinker_sessions.download_trace", token=token, _external=True)
    return jsonify(status="ready", url=url, error=None)


@bp.get("/api/v1/treadle/traces/<token>")
def download_trace(token: str) -> Any:
    with services().db.connect() as conn:
        data = trace_exports.redeem(conn, token)
    response = Response(data, mimetype="application/json")
    response.headers["Cache-Control"] = "no-store"
    return response


@bp.get("/api/v1/audit")
def audit() -> Any:
    query = parse(AuditQuery, request.args.to_dict())
    who = principal()
    if not who.is_admin:
        raise PermissionDeniedError(
            f"the audit log needs an admin key of the tenant; this is a {who.role} key: ask an "
            f"admin of tenant {who.tenant_id}"
        )
    day = (query.day or datetime.now(UTC)).astimezone(UTC).date()
    with services().db.connect() as conn:
        page = audit_log.read_day(conn, who, query.event_type, day)
    return jsonify(
        entries=[
            {
                "timestamp": _time(e.timestamp),
                "event": e.event,
                "event_details": e.details,
                "model_id": e.model_id,
                "tinker_path": e.tinker_path,
                "purpose": e.purpose,
            }
            for e in page.entries
        ],
        truncated=page.truncated,
    )


def _search(body: SearchSessions, who: Principal) -> views.Search:
    for project in body.project_ids or ():
        if project != who.tenant_id:
            raise ValidationError(
                f"project_ids: {project!r} is not a project you can list; Treadle's only "
                f"project is your tenant, {who.tenant_id!r}: omit project_ids or pass it"
            )
    owners: tuple[str, ...] | None
    if isinstance(body.owner, OwnOwner):
        owners = (who.key_id,)
    elif isinstance(body.owner, AccessibleOwner):
        owners = None
    else:
        owners = tuple(body.owner.owner_urns)
    after = None
    if body.cursor is not None:
        after = (body.cursor.last_created_at, body.cursor.last_session_id)
    return views.Search(
        limit=body.limit,
        session_id=body.session_id,
        display_words=tuple((body.display_name or "").lower().split()),
        user_metadata=body.user_metadata,
        statuses=None
        if body.statuses is None
        else tuple({s for q in body.statuses for s in _statuses(q)}),
        owners=owners,
        after=after,
    )


def _statuses(query: StatusQuery) -> tuple[ClientSessionStatus, ...]:
    """The client session statuses that read as `query` (see STATUSES)."""
    if isinstance(query, ActiveStatus):
        return (ClientSessionStatus.RUNNING,)
    if isinstance(query, CancelledStatus):
        return (ClientSessionStatus.EXPIRED,)
    if isinstance(query, FailedStatus):
        return ()
    assert isinstance(query, ClientFinishedStatus)
    if query.reasons is None or "success" in query.reasons:
        return (ClientSessionStatus.FINISHED,)
    return ()


def _summary(s: views.ClientSessionSummary) -> dict[str, Any]:
    return {
        "session_id": s.id,
        "created_at": _time(s.created_at),
        "owner": s.created_by or UNKNOWN_OWNER,
        "project_id": s.tenant_id,
        "status": STATUSES.get(s.status),
        "checkpoints_count": s.checkpoints_count,
        "display_name": s.display_name,
        "user_metadata": metadata_strings(s.user_metadata),
        "checkpoint_storage_bytes": s.checkpoint_storage_bytes,
    }


def metadata_strings(metadata: Any) -> dict[str, str]:
    """The protocol's user_metadata is string-valued; other JSON values go as their JSON."""
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in dict(metadata).items()}


def _time(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
