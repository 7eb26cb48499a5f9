"""Client bootstrap and session routes: client config, create_session, heartbeat, finish,
server capabilities, telemetry and health. Imports platform only; never torch.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from flask import Blueprint, jsonify

from treadle.api.app import json_body, principal, services
from treadle.api.schemas import CreateSession, FinishSession, SessionRef, parse
from treadle.platform import catalog, notify, operations, routing
from treadle.platform import sessions as sessions_core

bp = Blueprint("sessions", __name__)


@bp.get("/healthz")
@bp.get("/api/v1/healthz")
def healthz() -> Any:
    svc = services()
    with svc.db.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
    svc.redis.ping()
    return jsonify(status="ok")


@bp.post("/api/v1/client/config")
def client_config() -> Any:
    # Plain HTTP/1.1 with httpx; results are long-polled, so the SDK's defaults otherwise hold.
    return jsonify(use_pyqwest_transport=False, pjwt_auth_enabled=False)


@bp.post("/api/v1/client/dynamic_config")
def dynamic_config() -> Any:
    return jsonify(
        refresh_interval_sec=300, sample_cancel_enabled=False, sample_cancel_max_batch_size=64
    )


@bp.get("/api/v1/get_server_capabilities")
def server_capabilities() -> Any:
    models = [
        {
            "model_name": m.name,
            "max_context_length": m.max_context_length,
            "trainable": True,
            "sampleable": True,
        }
        for m in catalog.list_base_models()
    ]
    return jsonify(supported_models=models)


@bp.post("/api/v1/create_session")
def create_session() -> Any:
    body = parse(CreateSession, json_body())
    with services().db.begin() as conn:
        session_id = sessions_core.create_client_session(
            conn, principal(), body.tags, body.user_metadata
        )
    return jsonify(session_id=session_id)


@bp.post("/api/v1/session_heartbeat")
def session_heartbeat() -> Any:
    body = parse(SessionRef, json_body())
    with services().db.begin() as conn:
        status = sessions_core.heartbeat_client_session(conn, principal(), body.session_id)
    if status != "Running":
        return jsonify(
            error={"code": "gone", "message": f"session {body.session_id} is {status}"}
        ), 410
    return jsonify(type="session_heartbeat")


@bp.post("/api/v1/sessions/<session_id>/finish")
def finish_session(session_id: str) -> Any:
    body = parse(FinishSession, json_body() or {})
    svc = services()
    reason = str(body.reason.get("type", "success"))
    with svc.db.begin() as conn:
        stopped = sessions_core.finish_client_session(conn, principal(), session_id, reason)
        failed = [
            request_id
            for model_id in stopped
            for request_id in operations.fail_pending(
                conn, model_id, f"session {session_id} was finished"
            )
        ]
    for model_id in stopped:
        routing.request_stop(svc.celery, model_id)
    for request_id in failed:
        notify.publish_done(svc.redis, request_id)
    return jsonify(session_id=session_id, stopped=stopped)


@bp.post("/api/v1/telemetry")
def telemetry() -> Any:
    return jsonify(status="accepted")
