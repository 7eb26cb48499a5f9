"""The API's own description: `GET /api/v1/openapi.json` (public, like /healthz).

Imports platform only; never torch.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, current_app, jsonify

from treadle.api import openapi

bp = Blueprint("docs", __name__)


@bp.get("/api/v1/openapi.json")
def openapi_document() -> Any:
    return jsonify(openapi.document(current_app))  # type: ignore[arg-type]
