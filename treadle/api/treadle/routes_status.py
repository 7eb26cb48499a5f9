"""The operator's status view, `GET /api/v1/treadle/status` (what `treadle status` prints):
workers, live sessions per tenant, pending operations and the oldest of them.

The view reads through `platform.status` (where the operator check lives) on a read-only
connection and serialises. Imports platform only; never torch.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from flask import Blueprint, jsonify

from treadle.api.context import principal, services
from treadle.platform import db
from treadle.platform.sessions.status import read_status

bp = Blueprint("status", __name__, url_prefix="/api/v1/treadle")


@bp.get("/status")
def platform_status() -> Any:
    svc = services()
    with db.reading(svc.db) as conn:
        status = read_status(conn, principal(), svc.config.lease_ttl_seconds)
    return jsonify(asdict(status))
