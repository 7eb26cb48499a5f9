"""The model registry under /api/v1/treadle/base_models: anyone with a key lists and describes
the base models; the operator registers (a local folder, or a hub id at a pinned revision in the
hosts' Hugging Face cache) and retires them.

Views parse, call `platform.models.registry` (where the operator check lives) and serialise; a
registration and the prices it sets are one transaction.
Imports platform only; never torch.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify, request

from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.treadle.schemas_models import RegisterModel
from treadle.platform.billing import prices
from treadle.platform.models import model_files, registry

bp = Blueprint("models", __name__, url_prefix="/api/v1/treadle")


@bp.get("/base_models")
def list_models() -> Any:
    include_retired = request.args.get("include_retired", "").lower() in ("1", "true", "yes")
    with services().db.connect() as conn:
        found = registry.list_models(conn, include_retired=include_retired)
    return jsonify(base_models=[m.to_json() for m in found])


@bp.get("/base_models/<path:name>")
def describe_model(name: str) -> Any:
    with services().db.connect() as conn:
        found = registry.describe(conn, name)
    return jsonify(base_model=found.to_json())


@bp.post("/base_models")
def register_model() -> Any:
    body = parse(RegisterModel, json_body())
    options = model_files.Options(
        description=body.description,
        dtype=body.dtype,
        max_lora_rank=body.max_lora_rank,
        lora_targets=tuple(body.lora_targets),
        max_context_length=body.max_context_length,
    )
    who = principal()
    with services().db.begin() as conn:
        found = registry.register(
            conn, who, body.name, options, path=body.path, hub_id=body.hub_id,
            revision=body.revision, gguf_file=body.gguf_file,
        )  # fmt: skip
        for token_class, usd in (body.prices or {}).items():
            prices.set_price(
                conn, who, base_model=body.name, token_class=token_class, usd_per_million=usd
            )
    response = jsonify(base_model=found.to_json())
    response.status_code = 201
    return response


@bp.post("/base_models/<path:name>/retire")
def retire_model(name: str) -> Any:
    with services().db.begin() as conn:
        found = registry.retire(conn, principal(), name)
    return jsonify(base_model=found.to_json())
