"""Treadle's extensions under /api/v1/treadle: tokenizers, session stop and audit: the session
listing, a session's events (paged by position) and timeline (paged by seq), all in
`platform.audit` (tenants and keys are in `routes_admin`).

Imports platform only; never torch.
"""

from __future__ import annotations

import base64
import logging
from datetime import datetime
from typing import Any

import pydantic
from flask import Blueprint, jsonify, request

from treadle.api.body import Time
from treadle.api.context import int_arg, principal, services
from treadle.platform.audit import audit, session_listing
from treadle.platform.errors import ValidationError
from treadle.platform.models import tokenizers
from treadle.platform.operations import commands
from treadle.platform.sessions import sessions as sessions_core

log = logging.getLogger(__name__)

bp = Blueprint("treadle", __name__, url_prefix="/api/v1/treadle")
MAX_CURSOR = 2**62  # positions, seqs and offsets are BIGINTs
_TIME = pydantic.TypeAdapter(Time)


@bp.get("/tokenizer")
def tokenizer() -> Any:
    base_model = request.args.get("base_model", "")
    if not base_model:
        raise ValidationError("pass ?base_model=<name>; see GET /api/v1/treadle/base_models")
    info = services().models.get(base_model)
    files = tokenizers.tokenizer_files(info, services().config.cache_dir)
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
        source_session_id=s.source_session_id,  # a replay or fork: built from this session
        source_seq=s.source_seq,
    )


@bp.get("/sessions")
def list_sessions() -> Any:
    with services().db.connect() as conn:
        found = session_listing.list_sessions(
            conn,
            principal(),
            tenant=_text_arg("tenant"),
            status=_text_arg("status"),
            kind=_text_arg("kind"),
            since=_since_arg(),
            limit=int_arg("limit", 50, 1, audit.MAX_LIMIT),
            offset=int_arg("offset", 0, 0, MAX_CURSOR),
        )
    return jsonify(
        tenant_id=found.tenant_id,
        sessions=[s.to_json() for s in found.sessions],
        next_offset=found.next_offset,
    )


@bp.get("/sessions/<path:model_id>/events")
def session_events(model_id: str) -> Any:
    with services().db.connect() as conn:
        page = audit.events_page(
            conn,
            principal(),
            model_id,
            after=int_arg("after", 0, 0, MAX_CURSOR),
            limit=int_arg("limit", 100, 1, audit.MAX_LIMIT),
            types=[t.strip() for arg in request.args.getlist("type") for t in arg.split(",")],
            full=_bool_arg("full"),
        )
    return jsonify(
        model_id=page.session_id,
        status=page.status,
        events=[
            {
                "position": e.position,
                "session_id": e.session_id,
                "seq": e.seq,
                "type": e.type,
                "data": e.data,
                "actor": e.actor,
                "created_at": e.created_at.isoformat(),
                "tenant_id": e.tenant_id,
            }
            for e in page.events
        ],
        next_after=page.next_after,
        has_more=page.has_more,
    )


@bp.get("/sessions/<path:model_id>/timeline")
def session_timeline(model_id: str) -> Any:
    with services().db.connect() as conn:
        page = audit.timeline(
            conn,
            principal(),
            model_id,
            after=int_arg("after", 0, 0, MAX_CURSOR),
            limit=int_arg("limit", 100, 1, audit.MAX_LIMIT),
        )
    return jsonify(
        model_id=page.session_id,
        status=page.status,
        rows=[row.to_json() for row in page.rows],
        next_after=page.next_after,
        has_more=page.has_more,
    )


def _text_arg(name: str) -> str | None:
    value = request.args.get(name)
    if value is not None and not 1 <= len(value) <= 200:
        raise ValidationError(f"query parameter {name} must be 1-200 characters; leave it out")
    return value


def _bool_arg(name: str) -> bool:
    raw = request.args.get(name, "false").strip().lower()
    if raw in ("1", "true", "yes", ""):
        return True
    if raw in ("0", "false", "no"):
        return False
    raise ValidationError(f"query parameter {name} must be true or false, got {raw!r}")


def _since_arg() -> datetime | None:
    raw = request.args.get("since")
    if raw is None:
        return None
    try:
        return _TIME.validate_python(raw)
    except pydantic.ValidationError as exc:
        message = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ValidationError(f"query parameter since: {message}") from None
