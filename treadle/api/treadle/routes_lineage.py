"""Replay and fork under /api/v1/treadle/sessions/<id>: open a replay (a verified, read-only
rebuild of a session's log), open a fork (a new training session equal to the source after a
seq_id), and read how a replay's or fork's rebuild went.

Opening answers a future `{request_id, model_id}` like create_model; the future resolves when
the worker has rebuilt the new session. Imports platform only; never torch.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify

from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.treadle.schemas_lineage import OpenFork, OpenReplay
from treadle.platform.audit import lineage

bp = Blueprint("lineage", __name__, url_prefix="/api/v1/treadle")


@bp.post("/sessions/<path:model_id>/replay")
def open_replay(model_id: str) -> Any:
    body = parse(OpenReplay, json_body())
    admission = lineage.open_replay(
        services().deps,
        principal(),
        source_id=model_id,
        client_session_id=body.session_id,
        model_seq_id=body.model_seq_id,
        to_seq=body.to_seq,
    )
    return jsonify(request_id=admission.request_id, model_id=admission.session_id)


@bp.post("/sessions/<path:model_id>/fork")
def open_fork(model_id: str) -> Any:
    body = parse(OpenFork, json_body())
    admission = lineage.open_fork(
        services().deps,
        principal(),
        source_id=model_id,
        client_session_id=body.session_id,
        model_seq_id=body.model_seq_id,
        at_seq=body.at_seq,
        name=body.training_session_name,
    )
    return jsonify(request_id=admission.request_id, model_id=admission.session_id)


@bp.get("/sessions/<path:model_id>/rebuild")
def rebuild_report(model_id: str) -> Any:
    with services().db.connect() as conn:
        return jsonify(lineage.report(conn, principal(), model_id))
