"""Client bootstrap and session routes: client config, create_session, heartbeat, finish,
server capabilities, telemetry and health. Imports platform only; never torch.

/healthz reports each dependency and the live workers; it is ok (200) only when PostgreSQL and
Redis answer and at least one worker heartbeated within the lease TTL, else 503.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from flask import Blueprint, jsonify

from treadle.api.body import parse
from treadle.api.context import RETRY_AFTER_SECONDS, json_body, principal, services
from treadle.api.tinker.schemas import CreateSession, FinishSession, SessionRef
from treadle.platform.models import validation
from treadle.platform.operations import commands
from treadle.platform.sessions import leases
from treadle.platform.sessions import sessions as sessions_core

log = logging.getLogger(__name__)

bp = Blueprint("sessions", __name__)


@bp.get("/healthz")
@bp.get("/api/v1/healthz")
def healthz() -> Any:
    svc = services()
    live: list[str] = []
    try:
        with svc.probe_db.connect() as conn:
            live = leases.live_workers(conn, svc.config.lease_ttl_seconds)
        database: dict[str, Any] = {"ok": True, "error": None}
    except Exception as exc:  # reported, not raised: this route says what is down
        database = {"ok": False, "error": _first_line(exc)}
    try:
        svc.probe_redis.ping()
        redis_state: dict[str, Any] = {"ok": True, "error": None}
    except Exception as exc:
        redis_state = {"ok": False, "error": _first_line(exc)}
    ok = database["ok"] and redis_state["ok"] and bool(live)
    response = jsonify(
        status="ok" if ok else "unavailable",
        database=database,
        redis=redis_state,
        workers={"live": live, "count": len(live)},
    )
    if not ok:
        response.status_code = 503
        response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


@bp.post("/api/v1/client/config")
def client_config() -> Any:
    # Plain HTTP/1.1 with httpx; results are long-polled. forward_backward chunks stay within
    # the body limit (the SDK's estimate leaves out framing, hence half) and are sent uncompressed
    # (zstd bodies are refused). A request refused for money (402) is retried every 5 s for
    # the operator's billing pause (whole seconds: the SDK reads an int), then raised; with the
    # default 0 a loop ends after one retry instead of the SDK's hour. Its defaults otherwise
    # hold, but for custom losses, which run on the server (routes_custom_losses).
    config = services().config
    return jsonify(
        use_pyqwest_transport=False,
        pjwt_auth_enabled=False,
        # create_custom_loss uploads the traced loss; forward_backward runs it in one pass
        custom_loss_server_side=True,
        proto_compress_fwdbwd=False,
        fwdbwd_max_chunk_len=validation.FWDBWD_MAX_CHUNK_LEN,
        fwdbwd_max_chunk_bytes_count=config.fwdbwd_chunk_bytes,
        billing_exception_max_pause_duration_sec=math.ceil(config.billing_pause_seconds),
    )


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
        for m in services().models.active()
    ]
    return jsonify(supported_models=models)


@bp.post("/api/v1/create_session")
def create_session() -> Any:
    body = parse(CreateSession, json_body())
    with services().db.begin() as conn:
        session_id = sessions_core.create_client_session(
            conn, principal(), body.tags, body.user_metadata, body.display_name
        )
    return jsonify(session_id=session_id)


@bp.post("/api/v1/session_heartbeat")
def session_heartbeat() -> Any:
    body = parse(SessionRef, json_body())
    with services().db.begin() as conn:
        status = sessions_core.heartbeat_client_session(conn, principal(), body.session_id)
    if status != sessions_core.ClientSessionStatus.RUNNING:
        return jsonify(
            error={"code": "gone", "message": f"session {body.session_id} is {status}"}
        ), 410
    return jsonify(type="session_heartbeat")


@bp.post("/api/v1/sessions/<session_id>/finish")
def finish_session(session_id: str) -> Any:
    body = parse(FinishSession, json_body() or {})
    reason = str(body.reason.get("type", "success"))
    stopped = commands.finish_client_session(services().deps, principal(), session_id, reason)
    return jsonify(session_id=session_id, stopped=stopped)


@bp.post("/api/v1/telemetry")
def telemetry() -> Any:
    return jsonify(status="accepted")
