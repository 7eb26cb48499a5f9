"""`POST /api/v1/create_custom_loss`: a traced loss uploaded by `ServiceClient.create_custom_loss`.

The graph is checked against the allowlists (`platform.models.custom_losses`; a refusal is a 400
naming the node, and nothing is stored), then stored content-addressed under the tenant's prefix
(`tenants/<tenant>/custom_losses/<loss id>`). The answer is a future whose request id is the loss
id; retrieve_future resolves it to `{loss_id}` (`loss_future`). A forward_backward with
loss_fn "custom" and loss_fn_config {"loss_id"} reads the stored content into its event
(`resolve`), so replay, recovery and fork never need the store.
Views parse, call the platform, serialise. Imports platform only; never torch.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, jsonify

from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.tinker.schemas_extras import CreateCustomLoss
from treadle.platform.checkpoints import storage
from treadle.platform.errors import NotFoundError, ValidationError
from treadle.platform.models import custom_losses
from treadle.platform.sessions import sessions as sessions_core

bp = Blueprint("tinker_custom_losses", __name__, url_prefix="/api/v1")


@bp.post("/create_custom_loss")
def create_custom_loss() -> Any:
    body = parse(CreateCustomLoss, json_body())
    who = principal()
    with services().db.connect() as conn:
        sessions_core.get_client_session(conn, who, body.session_id)  # another tenant's: 404
    content = custom_losses.validate_loss(body.name, body.inputs, body.graph)
    loss_id = custom_losses.loss_id_of(content)
    key = _key(who.tenant_id, loss_id)
    store = services().store
    if not store.exists(key):
        store.put_bytes(key, custom_losses.canonical_json(content))
    return jsonify(request_id=loss_id)


def loss_future(request_id: str) -> dict[str, Any]:
    """retrieve_future's answer for a create_custom_loss future (its request id is the loss id)."""
    if not services().store.exists(_key(principal().tenant_id, request_id)):
        raise NotFoundError(f"future {request_id} not found")
    return {"type": "create_custom_loss", "loss_id": request_id}


def resolve(loss_id: str) -> dict[str, Any]:
    """The stored content of the caller's loss `loss_id`, with its id: what a forward_backward
    with loss_fn "custom" records. Re-checked against today's allowlists."""
    key = _key(principal().tenant_id, loss_id)
    store = services().store
    if not store.exists(key):
        raise ValidationError(
            f"custom loss {loss_id[:80]!r} was not created here; create it with "
            "ServiceClient.create_custom_loss and pass its LossHandle to forward_backward_custom"
        )
    stored = json.loads(store.get_bytes(key))
    content = custom_losses.validate_loss(stored["name"], stored["inputs"], _graph(stored))
    assert custom_losses.loss_id_of(content) == loss_id, "a stored loss matches its id"
    return {"loss_id": loss_id, **content}


def _graph(content: dict[str, Any]) -> dict[str, Any]:
    return {"format": 1, "nodes": content["nodes"]}


def _key(tenant_id: str, loss_id: str) -> str:
    if not (
        loss_id.startswith(custom_losses.LOSS_ID_PREFIX)
        and len(loss_id) == len(custom_losses.LOSS_ID_PREFIX) + 64
        and all(c in "0123456789abcdef" for c in loss_id[len(custom_losses.LOSS_ID_PREFIX) :])
    ):
        raise ValidationError(f"{loss_id[:80]!r} is not a custom loss id (closs-<sha256>)")
    return storage.tenant_key(tenant_id, "custom_losses", loss_id)
