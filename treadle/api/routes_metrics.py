"""`GET /metrics`: the API's Prometheus metrics (public, like /healthz; a scraper sends no key).

Imports platform only; never torch.
"""

from __future__ import annotations

from flask import Blueprint, Response

from treadle.api import telemetry
from treadle.api.context import services

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def prometheus_metrics() -> Response:
    body, content_type = telemetry.exposition(services().config)
    return Response(body, content_type=content_type)
