"""Sharing checkpoints beyond their run (the Tinker REST routes):

- `POST|DELETE /api/v1/training_runs/<run>/checkpoints/<id>/publish`: publish or unpublish
  (platform.publishing: published, any tenant's keys may read it; the owner's keys only change
  it). Idempotent: the SDK retries a 409 for minutes, so "already public" is a success.
- `POST /api/v1/copy_weights`: a copy with its own files in the caller's tenant
  (platform.copies); the SDK's X-Idempotency-Key makes a resent copy answer the first one.
- `GET .../checkpoints/<id>/external_weights_urls`: one-hour links, one per file, of an external
  weights checkpoint, served with no API key by `GET /api/v1/treadle/downloads/<token>/<file>`
  (app.PUBLIC_PREFIXES).

Views parse, call the platform, serialise. Imports platform only; never torch.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from flask import Blueprint, jsonify, request, send_file, url_for

from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.tinker.schemas_extras import CopyWeights
from treadle.platform.checkpoints import checkpoint_links, copies, publishing
from treadle.platform.errors import NotFoundError, ValidationError

bp = Blueprint("checkpoint_sharing", __name__)

IDEMPOTENCY_HEADER = "X-Idempotency-Key"
ACCESS_TOKEN_HEADER = "X-Tinker-Weights-Access-Token"
MAX_IDEMPOTENCY_KEY = 200
CHECKPOINT = "/api/v1/training_runs/<run_id>/checkpoints/<path:checkpoint_id>"


def _path(run_id: str, checkpoint_id: str) -> str:
    return f"tinker://{run_id}/{checkpoint_id}"


@bp.post(f"{CHECKPOINT}/publish")
def publish(run_id: str, checkpoint_id: str) -> Any:
    with services().db.begin() as conn:
        checkpoint = publishing.publish(conn, principal(), _path(run_id, checkpoint_id))
    return jsonify(checkpoint.to_json())


@bp.delete(f"{CHECKPOINT}/publish")
def unpublish(run_id: str, checkpoint_id: str) -> Any:
    with services().db.begin() as conn:
        checkpoint = publishing.unpublish(conn, principal(), _path(run_id, checkpoint_id))
    return jsonify(checkpoint.to_json())


@bp.post("/api/v1/copy_weights")
def copy_weights() -> Any:
    body = parse(CopyWeights, json_body())
    if body.weights_access_token is not None or request.headers.get(ACCESS_TOKEN_HEADER):
        raise ValidationError(
            "weights access tokens are not supported: a checkpoint of another tenant can be "
            "copied once its owner publishes it (tinker checkpoint publish <path>); omit the "
            "token"
        )
    key = request.headers.get(IDEMPOTENCY_HEADER) or None
    if key is not None and (len(key) > MAX_IDEMPOTENCY_KEY or "\x00" in key):
        raise ValidationError(
            f"the {IDEMPOTENCY_HEADER} header must be at most {MAX_IDEMPOTENCY_KEY} characters "
            "without NUL (the tinker SDK sends a UUID)"
        )
    svc = services()
    copied = copies.copy_weights(
        svc.db,
        svc.store,
        principal(),
        copies.CopyRequest(
            source_path=body.source_path,
            destination_project_id=body.destination_project_id,
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
            ttl_seconds=body.ttl_seconds,
            request_key=key,
        ),
    )
    return jsonify(tinker_path=str(copied.path))


@bp.get(f"{CHECKPOINT}/external_weights_urls")
def external_weights_urls(run_id: str, checkpoint_id: str) -> Any:
    svc = services()
    with svc.db.begin() as conn:
        token, checkpoint, expires = checkpoint_links.issue(
            conn, principal(), _path(run_id, checkpoint_id)
        )
    prefix = checkpoint.storage_prefix + "/"
    urls = {
        key[len(prefix) :]: url_for(
            "checkpoint_sharing.download_file",
            token=token,
            name=key[len(prefix) :],
            _external=True,
        )
        for key in svc.store.list(prefix)
    }
    return jsonify(urls=urls, expires=expires.isoformat())


@bp.get("/api/v1/treadle/downloads/<token>/<path:name>")
def download_file(token: str, name: str) -> Any:
    svc = services()
    with svc.db.connect() as conn:
        prefix = checkpoint_links.redeem(conn, token)
    key = f"{prefix}/{name}"
    if key not in svc.store.list(prefix + "/"):  # serve only the checkpoint's own files
        raise NotFoundError(
            f"the checkpoint has no file {name!r}; its links come from "
            "RestClient.get_external_weights_urls"
        )
    tmp = Path(tempfile.mkdtemp(prefix="treadle-download-")) / "file"
    svc.store.get_file(key, tmp)
    response = send_file(tmp, mimetype="application/octet-stream", download_name=Path(name).name)
    response.headers["Cache-Control"] = "no-store"
    response.call_on_close(lambda: shutil.rmtree(tmp.parent, ignore_errors=True))
    return response
