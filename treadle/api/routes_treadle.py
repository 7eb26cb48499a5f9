"""Treadle's extensions under /api/v1/treadle: tokenizers, session stop and audit (tenants and
keys are in `routes_admin`).

Imports platform only; never torch.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

from flask import Blueprint, jsonify, request

from treadle.api.context import principal, services
from treadle.platform import catalog, commands, events, tokenizers
from treadle.platform import sessions as sessions_core
from treadle.platform.errors import ValidationError

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
    commands.stop_session(services().deps, principal(), model_id)
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
