"""Checkpoint I/O on the worker: engine state <-> files <-> the object store.

A training checkpoint (`weights/<name>`) is a PEFT adapter folder plus the optimizer state; a
sampler checkpoint (`sampler_weights/<name>`) is the adapter folder, or with `merge_weights` a
full Hugging Face model folder loadable by `transformers` alone; external weights
(`external_weights/<name>`) are the adapter folder, each file age-encrypted as `<file>.age` when
the save names recipients (the plaintext only in this process's private temporary folder, each
file removed once encrypted, the folder before the save completes). Files go under the storage
prefix the API built for the tenant. Imports platform and the engine; never api.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from treadle.engine import EngineAPI
from treadle.platform.checkpoints import age_encryption, checkpoints
from treadle.platform.checkpoints.storage import ObjectStore
from treadle.platform.eventlog import events
from treadle.platform.eventlog.optypes import SaveWeights
from treadle.platform.eventlog.results import SaveWeightsOutput


def _upload(store: ObjectStore, folder: Path, prefix: str) -> int:
    store.delete_prefix(prefix + "/")
    size = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        store.put_file(f"{prefix}/{path.relative_to(folder).as_posix()}", path)
        size += path.stat().st_size
    return size


def _download(store: ObjectStore, prefix: str, folder: Path) -> None:
    keys = store.list(prefix + "/")
    if not keys:
        raise FileNotFoundError(f"no files under {prefix}")
    for key in keys:
        target = folder / key[len(prefix) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(key, target)


def save(
    engine: EngineAPI,
    store: ObjectStore,
    session_id: str,
    tenant_id: str,
    payload: SaveWeights,
) -> tuple[SaveWeightsOutput, Callable[[sa.Connection], dict[str, Any]]]:
    """Write the checkpoint; returns the result and the registration to run at settlement,
    which adds the version it registered (`model_package_group`, `version`) to the result."""
    path = checkpoints.parse_path(payload.path)
    folder = Path(tempfile.mkdtemp(prefix="treadle-save-"))
    try:
        if payload.merge_weights:
            engine.export_merged(session_id, folder)
        else:
            engine.export_adapter(session_id, folder, with_optimizer=payload.with_optimizer)
        if payload.age_encryption_recipients is not None:
            age_encryption.seal_folder(folder, payload.age_encryption_recipients)
        size = _upload(store, folder, payload.prefix)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    recipients = payload.age_encryption_recipients
    sealed = {"age_recipients": len(recipients)} if recipients is not None else {}

    def register(conn: sa.Connection) -> dict[str, Any]:
        saved = checkpoints.register(
            conn,
            tenant_id=tenant_id,
            path=path,
            storage_prefix=payload.prefix,
            size_bytes=size,
            has_optimizer=payload.with_optimizer,
            is_merged=payload.merge_weights,
            ttl_seconds=payload.ttl_seconds,
            description=payload.description,
        )
        events.append(
            conn,
            session_id,
            tenant_id,
            "CheckpointSaved",
            {"path": str(path), "version": saved.version, "group": saved.model_package_group,
             "size_bytes": size, "merged": saved.is_merged, **sealed},
        )  # fmt: skip
        return {"model_package_group": saved.model_package_group, "version": saved.version}

    return SaveWeightsOutput(path=str(path)), register


def load(
    engine: EngineAPI,
    store: ObjectStore,
    adapter_id: str,
    base_model: str,
    prefix: str,
    *,
    with_optimizer: bool,
    optimizer: str | None = None,
) -> None:
    """Load the checkpoint under `prefix` into `adapter_id`, replacing any adapter of that id
    (its samplers' snapshots stay), training with `optimizer` (None: the checkpoint's).
    FileNotFoundError when the files are gone."""
    folder = Path(tempfile.mkdtemp(prefix="treadle-load-"))
    try:
        _download(store, prefix, folder)
        if engine.has_adapter(adapter_id):
            engine.drop_adapter(adapter_id, keep_snapshots=True)
        engine.import_adapter(
            adapter_id, base_model, folder, with_optimizer=with_optimizer, optimizer=optimizer
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_point(engine: EngineAPI, store: ObjectStore, adapter_id: str, prefix: str) -> int:
    """Write the adapter's exact state (weights and optimizer; it has no pending grads at a
    recovery point) under `prefix`; returns the bytes written."""
    folder = Path(tempfile.mkdtemp(prefix="treadle-point-"))
    try:
        engine.export_adapter(adapter_id, folder, with_optimizer=True)
        return _upload(store, folder, prefix)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def ensure_snapshot(
    engine: EngineAPI, store: ObjectStore, snapshot_id: str, base_model: str, prefix: str
) -> None:
    """Make a checkpoint's adapter available to the sampler under `snapshot_id`."""
    if engine.has_snapshot(snapshot_id):
        return
    folder = Path(tempfile.mkdtemp(prefix="treadle-snapshot-"))
    try:
        _download(store, prefix, folder)
        engine.load_snapshot(snapshot_id, base_model, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
