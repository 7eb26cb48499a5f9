"""Sampling routes: create_sampling_session, samplers/<id>, asample.

A sampler made by `save_weights_for_sampler` runs on its training session's worker; one made
for a bare base model gets a sampling session of its own. Imports platform only; never torch.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from flask import Blueprint, jsonify

from treadle.api.admission import submit
from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.tinker.schemas import Chunk, CreateSamplingSession, PromptIdTable, Sample
from treadle.platform.checkpoints import age_encryption, publishing
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import optypes
from treadle.platform.models import validation, vision
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.models.vision import IMAGE_PLACEHOLDER
from treadle.platform.operations import commands, operations, recorded_samples
from treadle.platform.sessions import sessions as sessions_core

bp = Blueprint("sampling", __name__)

DEFAULT_MAX_TOKENS = 16


@bp.post("/api/v1/create_sampling_session")
def create_sampling_session() -> Any:
    body = parse(CreateSamplingSession, json_body())
    who = principal()
    checkpoint = None
    base_model = body.base_model
    if body.model_path is not None:
        with services().db.connect() as conn:
            # the caller's tenant's checkpoint, or another tenant's that is published
            checkpoint = publishing.get_readable(conn, who, body.model_path)
            base_model = sessions_core.get_session(conn, None, checkpoint.session_id).base_model
        if checkpoint.is_merged:
            raise ValidationError(
                f"{body.model_path} is a merged model export; sample from the adapter checkpoint "
                "(save without merge_weights) or load the folder with transformers"
            )
        prefix = checkpoint.storage_prefix + "/"
        if checkpoint.path.kind == "external_weights" and age_encryption.is_sealed(
            services().store.list(prefix)
        ):
            raise ValidationError(
                f"{body.model_path} is age-encrypted (saved with age_encryption_recipients), so "
                "Treadle cannot read it; sample from the training checkpoint it was exported "
                "from, or export it again without age_encryption_recipients"
            )
    if base_model is None:
        raise ValidationError("create_sampling_session needs base_model or model_path")
    if checkpoint is None:  # the bare base model: only one still in service
        services().models.require_active(base_model)
    else:  # a checkpoint's model, retired or not
        services().models.get(base_model)
    sampler = sessions_core.sampler_id(body.session_id, body.sampling_session_seq_id)

    def with_sampler(conn: sa.Connection) -> None:
        sessions_core.create_sampler(
            conn,
            who,
            sampler=sampler,
            client_session_id=body.session_id,
            session_id=sampler,
            base_model=base_model,
            snapshot_id=f"checkpoint:{checkpoint.path}" if checkpoint else None,
            model_path=str(checkpoint.path) if checkpoint else None,
            checkpoint_prefix=checkpoint.storage_prefix if checkpoint else None,
        )

    commands.open_session(
        services().deps,
        who,
        session_id=sampler,
        client_session_id=body.session_id,
        kind="sampling",
        base_model=base_model,
        with_session=with_sampler,
    )
    return jsonify(sampling_session_id=sampler)


@bp.get("/api/v1/samplers/<path:sampler>")
def get_sampler(sampler: str) -> Any:
    with services().db.connect() as conn:
        row = sessions_core.get_sampler(conn, principal(), sampler)
    return jsonify(sampler_id=row.id, base_model=row.base_model, model_path=row.model_path)


@bp.post("/api/v1/asample")
def asample() -> Any:
    body = parse(Sample, json_body())
    if body.sampling_session_id is None:
        raise ValidationError(
            "asample needs sampling_session_id; create one with create_sampling_session"
        )
    if body.topk_prompt_logprobs > validation.MAX_TOPK_LOGPROBS:
        raise ValidationError(
            f"topk_prompt_logprobs must be at most {validation.MAX_TOPK_LOGPROBS}"
        )
    params = body.sampling_params
    max_tokens = params.max_tokens or DEFAULT_MAX_TOKENS
    with services().db.connect() as conn:
        sampler = sessions_core.get_sampler(conn, principal(), body.sampling_session_id)
    model = services().models.get(sampler.base_model)
    tokens, images = _prompt(body.prompt.chunks, model)
    validation.validate_prompt(tokens, model, max_tokens)
    targets = body.target_prompt_logprobs
    validation.validate_prompt_scoring(
        tokens,
        model,
        prompt_logprobs=body.prompt_logprobs,
        topk=body.topk_prompt_logprobs,
        last_n=body.prompt_logprobs_last_n,
        alt_tokens_k=body.prompt_alt_tokens_k,
        targets=None if targets is None else targets.model_dump(),
    )
    stop = params.stop
    payload = optypes.Sample(
        prompt=tokens,
        snapshot_id=sampler.snapshot_id,
        checkpoint_prefix=sampler.checkpoint_prefix,
        num_samples=body.num_samples,
        prompt_logprobs=body.prompt_logprobs or body.topk_prompt_logprobs > 0,
        topk_prompt_logprobs=body.topk_prompt_logprobs,
        params=optypes.SamplingParams(
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stop=[stop] if isinstance(stop, str) else stop,
        ),
        prompt_logprobs_last_n=body.prompt_logprobs_last_n,
        target_prompt_logprobs=None if targets is None else _prompt_targets(targets),
        prompt_alt_tokens_k=body.prompt_alt_tokens_k,
        topk_sample_logprobs=body.topk_sample_logprobs,
        record_stability_info=bool(body.record_stability_info),
        images=images,
    )
    with_request = None
    if payload.record_stability_info:
        ttl = services().config.recorded_sample_ttl_seconds

        def with_request(conn: sa.Connection, admission: operations.Admission) -> None:
            recorded_samples.record(
                conn,
                principal(),
                request_id=admission.request_id,
                sampler_id=sampler.id,
                prompt=tokens,
                num_samples=body.num_samples,
                ttl_seconds=ttl,
            )

    admission = submit(
        sampler.session_id, body.seq_id, payload, sampler_id=sampler.id, with_request=with_request
    )
    return jsonify(
        request_id=admission.request_id,
        sample_sequence_ids=[f"{admission.request_id}:{i}" for i in range(body.num_samples)],
    )


def _prompt(
    chunks: list[Chunk], model: BaseModelInfo
) -> tuple[list[int], list[optypes.Image] | None]:
    """The prompt's tokens, each image's tokens among them (its placeholders made the model's
    image token: `vision.place_images`), and its images as the payload records them."""
    tokens: list[int] = []
    images: list[dict[str, Any]] = []
    for chunk in chunks:
        if chunk.type == "image":
            if chunk.data is None or chunk.format is None:
                raise ValidationError("prompt: an image chunk needs data (base64) and format")
            images.append(
                {"at": len(tokens), "format": chunk.format, "data": chunk.data,
                 "expected_tokens": chunk.expected_tokens}
            )  # fmt: skip
            tokens += [IMAGE_PLACEHOLDER] * (chunk.expected_tokens or 0)
        elif chunk.type == "encoded_text":
            tokens.extend(chunk.tokens)
        elif chunk.type == "image_asset_pointer":
            raise ValidationError(f"prompt: {vision.ASSET_POINTERS_REFUSED}")
        else:
            raise ValidationError(
                f"prompt has a {chunk.type} chunk; this server takes encoded_text and image chunks"
            )
    tokens, placed = vision.place_images("prompt", tokens, images, model.vision, model.name)
    return tokens, [optypes.Image.model_validate(p) for p in placed] or None


def _prompt_targets(table: PromptIdTable) -> optypes.PromptTargets:
    """A validated target_prompt_logprobs table as the payload stores it."""
    assert table.shape is not None, "validate_prompt_scoring checked the shape"
    return optypes.PromptTargets(
        rows=table.shape[0],
        k=table.shape[1],
        ids=table.data,
        crow_indices=table.sparse_crow_indices,
        col_indices=table.sparse_col_indices,
    )
