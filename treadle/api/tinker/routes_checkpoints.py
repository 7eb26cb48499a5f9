"""Checkpoint routes: save_weights (save_state), save_weights_for_sampler (named, merged or
ephemeral), save_weights_external (a PEFT adapter folder as tinker://<run>/external_weights/<name>,
its files age-encrypted as <file>.age when the request names age_encryption_recipients),
load_weights (create-via-load and legacy load_state), and the Tinker REST registry
(training_runs, checkpoints, weights_info). Reading a checkpoint (loading it, its weights info,
its files) works for the caller's tenant's and for published ones (platform.publishing); the
registry's listings and changes are the owner's only. Imports platform only; never torch.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from flask import Blueprint, jsonify, request, send_file

from treadle.api.admission import parse_training, submit
from treadle.api.body import parse
from treadle.api.context import int_arg, json_body, principal, services
from treadle.api.tinker import optimizers
from treadle.api.tinker.schemas import (
    CheckpointTtl,
    LoadWeights,
    SaveWeights,
    SaveWeightsForSampler,
    WeightsInfo,
)
from treadle.api.tinker.schemas_extras import SaveWeightsExternal
from treadle.platform.checkpoints import age_encryption, checkpoints, publishing
from treadle.platform.errors import NotFoundError, ValidationError
from treadle.platform.eventlog import optypes
from treadle.platform.operations import commands, operations
from treadle.platform.sessions import sessions as sessions_core

bp = Blueprint("checkpoints", __name__, url_prefix="/api/v1")


def _submit_save(
    model_id: str,
    seq_id: int,
    kind: str,
    name: str,
    *,
    ttl_seconds: int | None,
    with_optimizer: bool,
    merge_weights: bool,
    overwrite: bool = True,
    age_encryption_recipients: list[str] | None = None,
) -> Any:
    """Admit a checkpoint save: the worker writes the files and registers the version."""
    path = checkpoints.CheckpointPath(model_id, kind, checkpoints.validate_name(name))
    if not overwrite:
        with services().db.connect() as conn:
            if checkpoints.exists(conn, principal(), path):
                raise ValidationError(f"{path} already exists; pass overwrite=true or another name")
    payload = optypes.SaveWeights(
        path=str(path),
        prefix=checkpoints.storage_prefix(principal().tenant_id, path),
        ttl_seconds=ttl_seconds,
        with_optimizer=with_optimizer,
        merge_weights=merge_weights,
        age_encryption_recipients=age_encryption_recipients,
    )
    admission = submit(model_id, seq_id, payload)
    return jsonify(request_id=admission.request_id, model_id=model_id)


@bp.post("/save_weights")
def save_weights() -> Any:
    body = parse_training(SaveWeights)
    return _submit_save(
        body.model_id,
        body.seq_id,
        "weights",
        body.path,
        ttl_seconds=body.ttl_seconds,
        with_optimizer=True,
        merge_weights=False,
        overwrite=body.overwrite,
    )


@bp.post("/save_weights_for_sampler")
def save_weights_for_sampler() -> Any:
    body = parse_training(SaveWeightsForSampler)
    if body.kind not in (None, "snapshot", "inflight"):
        raise ValidationError(
            f"kind {body.kind!r} is not a sampler kind; use 'snapshot' or 'inflight'"
        )
    inflight = body.kind == "inflight"
    if inflight and body.path is not None:
        raise ValidationError(
            "an inflight sampler follows the session's live weights and saves no checkpoint: "
            "omit path (or use kind='snapshot' to save named weights)"
        )
    if body.path is not None:
        return _submit_save(
            body.model_id,
            body.seq_id,
            "sampler_weights",
            body.path,
            ttl_seconds=body.ttl_seconds,
            with_optimizer=False,
            merge_weights=body.merge_weights,
        )
    if body.sampling_session_seq_id is None:
        raise ValidationError(
            "save_weights_for_sampler needs a path (a name) or sampling_session_seq_id"
        )
    if body.merge_weights:
        raise ValidationError("merge_weights needs a named checkpoint: pass path=<name>")
    with services().db.connect() as conn:
        session = sessions_core.get_session(conn, principal(), body.model_id)
    sampler = sessions_core.sampler_id(session.client_session_id, body.sampling_session_seq_id)
    # An inflight sampler shares the session's one inflight snapshot, which every inflight save
    # replaces: earlier inflight samplers adopt the newer weights, a new one starts on them.
    snapshot = optypes.inflight_snapshot_id(session.id) if inflight else sampler

    def create_sampler(conn: sa.Connection, _: operations.Admission) -> None:
        sessions_core.create_sampler(
            conn,
            principal(),
            sampler=sampler,
            client_session_id=session.client_session_id,
            session_id=session.id,
            base_model=session.base_model,
            snapshot_id=snapshot,
        )

    admission = submit(
        body.model_id,
        body.seq_id,
        optypes.SaveWeightsForSampler(
            sampler_id=sampler, snapshot_id=snapshot if inflight else None
        ),
        with_request=create_sampler,
    )
    return jsonify(request_id=admission.request_id, model_id=body.model_id)


@bp.post("/save_weights_external")
def save_weights_external() -> Any:
    body = parse_training(SaveWeightsExternal)
    if body.age_encryption_recipients is not None:  # refused before anything is recorded
        age_encryption.parse_recipients(body.age_encryption_recipients)
    return _submit_save(
        body.model_id,
        body.seq_id,
        "external_weights",
        body.path,
        ttl_seconds=body.ttl_seconds,
        with_optimizer=False,
        merge_weights=False,
        age_encryption_recipients=body.age_encryption_recipients,
    )


@bp.post("/load_weights")
def load_weights() -> Any:
    body = parse_training(LoadWeights)
    raw = json_body()
    if isinstance(raw, dict) and raw.get("weights_access_token") is not None:
        raise ValidationError(
            "weights_access_token is not supported: a checkpoint of another tenant is readable "
            "once its owner publishes it (tinker checkpoint publish <path>); omit the token"
        )
    who = principal()
    with services().db.connect() as conn:
        checkpoint = publishing.get_readable(conn, who, body.path)
        source = sessions_core.get_session(conn, None, checkpoint.session_id)
    if checkpoint.path.kind != "weights":
        raise ValidationError(
            f"{body.path} holds {checkpoints.KINDS[checkpoint.path.kind]} weights, which cannot "
            "be loaded to train on; load a training checkpoint (tinker://<run id>/weights/<name>)"
        )
    if body.optimizer and not checkpoint.has_optimizer:
        raise ValidationError(f"{body.path} has no optimizer state; load it without the optimizer")
    saved_optimizer = optimizers.session_optimizer(source.lora_config)
    asked = None if body.optimizer_config is None else optimizers.name_of(body.optimizer_config)
    if body.optimizer and asked not in (None, saved_optimizer):
        raise ValidationError(
            f"{body.path} holds {saved_optimizer} optimizer state, which cannot train with "
            f"{asked}; load it without the optimizer state to train with {asked}"
        )
    # with the optimizer state, the checkpoint's optimizer; without it, the one asked for
    optimizer = saved_optimizer if body.optimizer else (asked or "adamw")
    payload = optypes.LoadWeights(
        path=str(checkpoint.path),
        prefix=checkpoint.storage_prefix,
        optimizer=body.optimizer,
        base_model=source.base_model,
        lora_config=optypes.LoraConfig(**optimizers.with_optimizer(source.lora_config, optimizer)),
    )
    if body.model_id is not None:  # legacy load_state into an existing model
        if body.seq_id is None:
            raise ValidationError("load_weights into model_id needs seq_id")
        with services().db.connect() as conn:
            target = sessions_core.get_session(conn, who, body.model_id)
        if target.base_model != source.base_model:
            raise ValidationError(
                f"{body.path} was trained on {source.base_model}; model {target.id} uses {target.base_model}"
            )
        if body.optimizer_config is not None:
            raise ValidationError(
                "optimizer_config is for a new model; an existing model keeps its optimizer"
            )
        target_optimizer = optimizers.session_optimizer(target.lora_config)
        if body.optimizer and saved_optimizer != target_optimizer:
            raise ValidationError(
                f"{body.path} holds {saved_optimizer} optimizer state; model {target.id} trains "
                f"with {target_optimizer}: load the checkpoint without its optimizer state"
            )
        lora = optimizers.with_optimizer(source.lora_config, target_optimizer)
        payload = payload.model_copy(update={"lora_config": optypes.LoraConfig(**lora)})
        admission = submit(body.model_id, body.seq_id, payload)
        return jsonify(request_id=admission.request_id, model_id=body.model_id)
    if body.session_id is None or body.model_seq_id is None:
        raise ValidationError(
            "load_weights needs session_id and model_seq_id (or model_id and seq_id)"
        )
    if body.base_model is not None and body.base_model != source.base_model:
        raise ValidationError(
            f"{body.path} was trained on {source.base_model}, not {body.base_model}"
        )
    model_id = sessions_core.training_session_id(body.session_id, body.model_seq_id)
    own = source.tenant_id == who.tenant_id  # another tenant's names stay its own
    opened = commands.open_session(
        services().deps,
        who,
        session_id=model_id,
        client_session_id=body.session_id,
        kind="training",
        base_model=source.base_model,
        first=payload.model_copy(update={"create": True}),
        name=source.name if own else None,
        lora_config=optimizers.with_optimizer(source.lora_config, optimizer),
        model_package_group=source.model_package_group if own else None,
    )
    assert opened is not None, "a training session's first operation is always admitted"
    return jsonify(request_id=opened.request_id, model_id=model_id)


# --- the registry (Tinker REST shape) -----------------------------------------------------


def _training_run(
    session: sessions_core.SessionRow, last: checkpoints.Checkpoint | None
) -> dict[str, Any]:
    return {
        "training_run_id": session.id,
        "base_model": session.base_model,
        "model_owner": session.tenant_id,
        "is_lora": True,
        "lora_rank": session.lora_config.get("rank"),
        "last_request_time": session.updated_at.isoformat() if session.updated_at else None,
        "last_checkpoint": last.to_json() if last else None,
        "user_metadata": dict(session.user_metadata or {}),
        "training_session_name": session.name,
        "model_package_group": session.model_package_group,
        "status": session.status,
    }


@bp.get("/training_runs")
def training_runs() -> Any:
    limit = int_arg("limit", 20, 1, 1000)
    offset = int_arg("offset", 0, 0, 2**31)
    with services().db.connect() as conn:
        page, total = sessions_core.list_sessions(
            conn, principal(), kind="training", limit=limit, offset=offset
        )
        latest = checkpoints.latest_for(conn, principal(), [s.id for s in page])
    out = [_training_run(s, latest.get(s.id)) for s in page]
    return jsonify(
        training_runs=out, cursor={"offset": offset, "limit": limit, "total_count": total}
    )


@bp.get("/training_runs/<run_id>")
def training_run(run_id: str) -> Any:
    with services().db.connect() as conn:
        session = sessions_core.get_session(conn, principal(), run_id)
        latest = checkpoints.latest_for(conn, principal(), [run_id])
    return jsonify(_training_run(session, latest.get(run_id)))


@bp.get("/training_runs/<run_id>/checkpoints")
def run_checkpoints(run_id: str) -> Any:
    with services().db.connect() as conn:
        sessions_core.get_session(conn, principal(), run_id)
        saved, _ = checkpoints.list_for(conn, principal(), run_id=run_id)
    return jsonify(checkpoints=[c.to_json() for c in saved])


@bp.get("/checkpoints")
def all_checkpoints() -> Any:
    group = request.args.get("model_package_group")
    limit = int_arg("limit", 100, 1, 1000)
    offset = int_arg("offset", 0, 0, 2**31)
    with services().db.connect() as conn:
        page, total = checkpoints.list_for(
            conn, principal(), group=group, limit=limit, offset=offset
        )
    return jsonify(
        checkpoints=[c.to_json() for c in page],
        cursor={"offset": offset, "limit": limit, "total_count": total},
    )


def _path(run_id: str, checkpoint_id: str) -> str:
    return f"tinker://{run_id}/{checkpoint_id}"


@bp.delete("/training_runs/<run_id>/checkpoints/<path:checkpoint_id>")
def delete_checkpoint(run_id: str, checkpoint_id: str) -> Any:
    svc = services()
    with svc.db.begin() as conn:
        checkpoint = checkpoints.delete(conn, principal(), _path(run_id, checkpoint_id))
    svc.store.delete_prefix(checkpoint.storage_prefix + "/")  # its own files, no sibling's
    return jsonify(deleted=str(checkpoint.path))


@bp.put("/training_runs/<run_id>/checkpoints/<path:checkpoint_id>/ttl")
@bp.post("/training_runs/<run_id>/checkpoints/<path:checkpoint_id>/ttl")
def checkpoint_ttl(run_id: str, checkpoint_id: str) -> Any:
    body = parse(CheckpointTtl, json_body() or {})
    with services().db.begin() as conn:
        checkpoint = checkpoints.set_ttl(
            conn, principal(), _path(run_id, checkpoint_id), body.ttl_seconds
        )
    return jsonify(checkpoint.to_json())


@bp.post("/weights_info")
def weights_info() -> Any:
    body = parse(WeightsInfo, json_body())
    with services().db.connect() as conn:
        checkpoint = publishing.get_readable(conn, principal(), body.tinker_path)
        session = sessions_core.get_session(conn, None, checkpoint.session_id)
    return jsonify(
        base_model=session.base_model,
        is_lora=not checkpoint.is_merged,
        lora_rank=session.lora_config.get("rank"),
        train_unembed=session.lora_config.get("train_unembed"),
        train_mlp=session.lora_config.get("train_mlp"),
        train_attn=session.lora_config.get("train_attn"),
        optimizer_config=optimizers.config_json(session.lora_config),
    )


# --- download (Treadle extension) ---------------------------------------------------------


@bp.get("/treadle/checkpoints/files")
def checkpoint_files() -> Any:
    path = request.args.get("path", "")
    svc = services()
    with svc.db.connect() as conn:
        checkpoint = publishing.get_readable(conn, principal(), path)
    store = svc.store
    prefix = checkpoint.storage_prefix + "/"
    files = [{"name": key[len(prefix) :], "size": store.size(key)} for key in store.list(prefix)]
    return jsonify(checkpoint=checkpoint.to_json(), files=files)


@bp.get("/treadle/checkpoints/file")
def checkpoint_file() -> Any:
    path, name = request.args.get("path", ""), request.args.get("name", "")
    svc = services()
    with svc.db.connect() as conn:
        checkpoint = publishing.get_readable(conn, principal(), path)
    store = svc.store
    key = f"{checkpoint.storage_prefix}/{name}"
    if key not in store.list(checkpoint.storage_prefix + "/"):  # serve only listed files
        raise NotFoundError(
            f"{path} has no file {name!r}; see GET /api/v1/treadle/checkpoints/files"
        )
    tmp = Path(tempfile.mkdtemp(prefix="treadle-download-")) / "file"
    store.get_file(key, tmp)
    response = send_file(tmp, mimetype="application/octet-stream", download_name=Path(name).name)
    response.call_on_close(lambda: shutil.rmtree(tmp.parent, ignore_errors=True))
    return response
