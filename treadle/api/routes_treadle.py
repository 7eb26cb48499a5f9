"""Treadle's extensions under /api/v1/treadle: tokenizers, session stop and audit, tenants.

Imports platform only; never torch.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import kombu.exceptions
from flask import Blueprint, jsonify, request

from treadle.api.app import json_body, principal, services
from treadle.api.schemas import CreateTenant, parse
from treadle.platform import catalog, events, notify, operations, routing, tenants, tokenizers
from treadle.platform import sessions as sessions_core
from treadle.platform.errors import PermissionDeniedError, ValidationError

log = logging.getLogger(__name__)

bp = Blueprint("treadle", __name__, url_prefix="/api/v1/treadle")


@bp.get("/base_models")
def base_models() -> Any:
    return jsonify(
        base_models=[
            {
                "name": m.name,
                "max_context_length": m.max_context_length,
                "vocab_size": m.vocab_size,
                "description": m.description,
            }
            for m in catalog.list_base_models()
        ]
    )


@bp.get("/tokenizer")
def tokenizer() -> Any:
    base_model = request.args.get("base_model", "")
    if not base_model:
        raise ValidationError("pass ?base_model=<name>; see GET /api/v1/treadle/base_models")
    catalog.get_base_model(base_model)
    files = tokenizers.tokenizer_files(base_model, services().config.cache_dir)
    return jsonify(
        base_model=base_model,
        files={name: base64.b64encode(content).decode() for name, content in files.items()},
    )


@bp.post("/sessions/<path:model_id>/stop")
def stop(model_id: str) -> Any:
    svc = services()
    with svc.db.begin() as conn:
        stopped = sessions_core.stop_session(conn, principal(), model_id, "stopped by client")
        failed = operations.fail_pending(conn, model_id, f"model {model_id} was stopped")
    if stopped:
        try:
            routing.request_stop(svc.celery, model_id)
        except kombu.exceptions.OperationalError as exc:  # its worker sees the status anyway
            log.warning("could not send the stop of %s: %s", model_id, exc)
    for request_id in failed:
        notify.publish_done(svc.redis, request_id)
    return jsonify(model_id=model_id, status="Stopped")


@bp.get("/sessions/<path:model_id>")
def describe(model_id: str) -> Any:
    with services().db.connect() as conn:
        s = sessions_core.get_session(conn, principal(), model_id)
    return jsonify(
        model_id=s.id,
        kind=s.kind,
        name=s.name,
        base_model=s.base_model,
        lora_config=dict(s.lora_config),
        status=s.status,
        last_applied_seq=s.last_applied_seq,
    )


@bp.get("/sessions/<path:model_id>/events")
def session_events(model_id: str) -> Any:
    with services().db.connect() as conn:
        sessions_core.get_session(conn, principal(), model_id)
        stream = events.read_stream(conn, model_id)
    return jsonify(
        events=[
            {
                "position": e.position,
                "seq": e.seq,
                "type": e.type,
                "data": e.data,
                "actor": e.actor,
                "created_at": e.created_at.isoformat(),
            }
            for e in stream
        ]
    )


@bp.post("/tenants")
def create_tenant() -> Any:
    if not principal().is_admin:
        raise PermissionDeniedError("creating tenants needs an admin key")
    body = parse(CreateTenant, json_body())
    with services().db.begin() as conn:
        tenants.ensure_tenant(conn, body.id, body.name)
        key_id, plaintext = tenants.create_key(conn, body.id, body.role)
    return jsonify(tenant_id=body.id, key_id=key_id, api_key=plaintext), 201
