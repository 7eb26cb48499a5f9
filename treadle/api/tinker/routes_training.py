"""Training routes: create_model (with its optimizer), get_info, forward_backward, optim_step and sampler saves.

Each operation is appended to the session's log before its wake-up is enqueued; the answer is a
future `{request_id, model_id}` resolved through retrieve_future. Imports platform only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from flask import Blueprint, jsonify, request

from treadle.api.admission import expect_seq, parse_training, submit
from treadle.api.body import parse
from treadle.api.context import base_model_of, json_body, principal, services
from treadle.api.tinker import optimizers, routes_custom_losses
from treadle.api.tinker.schemas import CreateModel, ModelRef, OptimStep
from treadle.api.tinker.wire import decode_forward_backward
from treadle.platform.billing import prices
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import optypes
from treadle.platform.models import custom_losses, validation, vision
from treadle.platform.operations import commands, operations, recorded_samples
from treadle.platform.sessions import sessions as sessions_core

bp = Blueprint("training", __name__)

DEFAULT_LORA_ALPHA = 32.0


@bp.post("/api/v1/create_model")
def create_model() -> Any:
    body = parse(CreateModel, json_body())
    info = services().models.require_active(body.base_model)
    name = sessions_core.ensure_valid_name(body.training_session_name)
    lora = body.lora_config
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise ValidationError("lora_config must train at least one of attn, mlp or unembed")
    info.check_lora(lora.rank, lora.train_attn, lora.train_mlp, lora.train_unembed)
    lora_config = {
        "rank": lora.rank,
        "alpha": lora.alpha if lora.alpha is not None else DEFAULT_LORA_ALPHA,
        "seed": lora.seed if lora.seed is not None else 0,
        "train_attn": lora.train_attn,
        "train_mlp": lora.train_mlp,
        "train_unembed": lora.train_unembed,
    }
    # recorded in the session and its first event: recovery, replay and fork rebuild with it
    lora_config = optimizers.with_optimizer(lora_config, optimizers.name_of(body.optimizer_config))
    model_id = sessions_core.training_session_id(body.session_id, body.model_seq_id)
    opened = commands.open_session(
        services().deps,
        principal(),
        session_id=model_id,
        client_session_id=body.session_id,
        kind="training",
        base_model=body.base_model,
        first=optypes.CreateModel(
            base_model=body.base_model, lora_config=optypes.LoraConfig(**lora_config)
        ),
        name=name,
        lora_config=lora_config,
        user_metadata=body.user_metadata,
        model_package_group=sessions_core.ensure_valid_name(body.model_package_group),
        max_cost_micro_usd=None
        if body.max_cost_usd is None
        else prices.usd_to_micro(body.max_cost_usd, "max_cost_usd"),
    )
    assert opened is not None, "a training session's first operation is always admitted"
    return jsonify(request_id=opened.request_id, model_id=model_id)


@bp.post("/api/v1/get_info")
def get_info() -> Any:
    body = parse(ModelRef, json_body())
    with services().db.connect() as conn:
        session = sessions_core.get_session(conn, principal(), body.model_id)
    info = services().models.get(session.base_model)
    return jsonify(
        model_id=session.id,
        model_data={
            "arch": info.model_type,
            "model_name": session.base_model,
            # The SDK's get_tokenizer() loads this hub repo: huggingface.co has it, and so has
            # Treadle's hub-compatible /hf endpoint (HF_ENDPOINT=<treadle>/hf; routes_hf).
            "tokenizer_id": info.tokenizer_id,
        },
        is_lora=True,
        lora_rank=session.lora_config.get("rank"),
        lora_alpha=session.lora_config.get("alpha"),
        optimizer_config=optimizers.config_json(session.lora_config),
        training_session_name=session.name,
        status=session.status,
    )


@bp.post("/api/v1/forward_backward")
def forward_backward() -> Any:
    if request.headers.get("Content-Encoding", "").lower() == "zstd":
        raise ValidationError(
            "zstd-compressed forward_backward bodies are not accepted; send it plain"
        )
    decoded = decode_forward_backward(request.get_data(), on_seq=expect_seq)
    model_id, payload = decoded["model_id"], decoded["payload"]
    if decoded["seq_id"] < 1:
        raise ValidationError("seq_id must be >= 1 (the first operation after create_model is 1)")
    model = services().models.get(base_model_of(model_id))
    for i, datum in enumerate(payload["data"]):
        datum["tokens"], placed = vision.place_images(
            f"datum {i}", datum["tokens"], datum.pop("images", []), model.vision, model.name
        )
        if placed:
            datum["images"] = placed
    with_request = None
    if payload["loss_fn"] == "custom":  # create_custom_loss's: its content goes into the event
        if decoded["loss_id"] is None:
            raise ValidationError(
                "loss_fn 'custom' needs loss_fn_config['loss_id'], the id create_custom_loss "
                "returned; pass the LossHandle to forward_backward_custom"
            )
        payload["custom_loss"] = routes_custom_losses.resolve(decoded["loss_id"])
        custom_losses.validate_custom_forward_backward(payload, model, payload["custom_loss"])
        for datum in payload["data"]:
            datum.pop("provenance", None)
        return _submit(model_id, decoded["seq_id"], payload, None)
    spec, payload["loss_fn_config"] = validation.validate_forward_backward(payload, model)
    if spec.reads_provenance:
        with_request = _with_provenance(model_id, payload["data"])
        validation.validate_sampled_advantages(payload["data"], spec)
    else:  # a loss that does not read provenance ignores it, but for the KL metric's mask
        for datum in payload["data"]:
            provenance = datum.pop("provenance", None)
            if provenance is None or "logprobs" not in spec.inputs:
                continue
            marks = recorded_samples.sampled_targets(provenance["targets"], len(datum["tokens"]))
            if marks is not None:
                datum["sampled_targets"] = marks
    return _submit(model_id, decoded["seq_id"], payload, with_request)


def _submit(
    model_id: str,
    seq_id: int,
    payload: dict[str, Any],
    with_request: Callable[[sa.Connection, operations.Admission], None] | None,
) -> Any:
    admission = submit(
        model_id, seq_id, optypes.ForwardBackward.model_validate(payload), with_request=with_request
    )
    return jsonify(request_id=admission.request_id, model_id=model_id)


def _with_provenance(
    model_id: str, data: list[dict[str, Any]]
) -> Callable[[sa.Connection, operations.Admission], None]:
    """Check every datum's provenance against the recorded sequences and put the recorded
    sampler logprobs in it; what marks those records used in the admission's transaction."""
    svc, who = services(), principal()
    ttl = svc.config.recorded_sample_ttl_seconds
    with svc.db.connect() as conn:
        session = sessions_core.get_session(conn, who, model_id)
        logprobs, used = recorded_samples.resolve(conn, who, session, data, ttl_seconds=ttl)
    for datum, sampler_logprobs in zip(data, logprobs, strict=True):
        datum["provenance"]["sampler_logprobs"] = sampler_logprobs

    def touch(conn: sa.Connection, _: operations.Admission) -> None:
        recorded_samples.touch(conn, used, ttl_seconds=ttl)

    return touch


@bp.post("/api/v1/optim_step")
def optim_step() -> Any:
    body = parse_training(OptimStep)
    payload = optimizers.optim_step_payload(body, json_body())
    admission = submit(body.model_id, body.seq_id, payload)
    return jsonify(request_id=admission.request_id, model_id=body.model_id)
