"""Copying a checkpoint (`copy_weights`): a new checkpoint of the caller's tenant with its own
files, in a new training run that holds checkpoints only and cannot be trained on.

The source is any checkpoint the caller may read (its tenant's, or a published one); the copy
keeps its kind and name and gets new files under the caller's storage prefix, copied through the
ObjectStore, so deleting or unpublishing the source never touches the copy. The new run is
`<session_id>:train:<model_seq_id>` when the caller names one of its running client sessions,
else the run 0 of a new, finished client session. A request key (the SDK's X-Idempotency-Key)
makes a resent copy answer the first one's path. Owns `checkpoints.copied_from` and
`copy_request_key`. Imports nothing from api, engine, worker, Flask or torch.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from treadle.platform.checkpoints import checkpoints, publishing, storage
from treadle.platform.checkpoints.storage import ObjectStore
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import events
from treadle.platform.eventlog.schema import checkpoints as checkpoint_rows
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.tenancy.tenants import Principal

COPY_REASON = "a copy made by copy_weights: it holds checkpoints only and cannot be trained on"


@dataclass(frozen=True)
class CopyRequest:
    source_path: str
    destination_project_id: str | None = None
    session_id: str | None = None  # with model_seq_id: the run the copy goes into
    model_seq_id: int | None = None
    ttl_seconds: int | None = None
    request_key: str | None = None  # X-Idempotency-Key


def copy_weights(
    db: sa.Engine, store: ObjectStore, principal: Principal, request: CopyRequest
) -> checkpoints.Checkpoint:
    """Copy the checkpoint; returns the copy (the first copy again for a resent request key).
    A source the caller may not read is a 404 before anything else is looked at."""
    with db.connect() as conn:
        earlier = _earlier_copy(conn, principal, request.request_key)
        if earlier is not None:
            return earlier
        source = publishing.get_readable(conn, principal, request.source_path)
        source_session = sessions_core.get_session(conn, None, source.session_id)
        _check_destination(principal, request)
        if request.session_id is not None:
            sessions_core.require_running_client_session(conn, principal, request.session_id)
    prefix = storage.tenant_key(
        principal.tenant_id, "copies", secrets.token_hex(8), source.path.kind, source.path.name
    )
    size = _copy_files(store, source, prefix)
    try:
        with db.begin() as conn:
            if request.request_key is not None:  # one copy per key, however many race
                conn.execute(
                    sa.select(
                        sa.func.pg_advisory_xact_lock(
                            sa.func.hashtext(f"copy/{principal.tenant_id}/{request.request_key}")
                        )
                    )
                )
                earlier = _earlier_copy(conn, principal, request.request_key)
                if earlier is not None:
                    store.delete_prefix(prefix + "/")
                    return earlier
            run_id = _new_run(conn, principal, request, source, source_session)
            path = checkpoints.CheckpointPath(run_id, source.path.kind, source.path.name)
            copied = checkpoints.register(
                conn,
                tenant_id=principal.tenant_id,
                path=path,
                storage_prefix=prefix,
                size_bytes=size,
                has_optimizer=source.has_optimizer,
                is_merged=source.is_merged,
                ttl_seconds=request.ttl_seconds,
            )
            conn.execute(
                sa.update(checkpoint_rows)
                .where(
                    checkpoint_rows.c.tinker_path == str(path),
                    checkpoint_rows.c.deleted_at.is_(None),
                )
                .values(copied_from=str(source.path), copy_request_key=request.request_key)
            )
            events.append(
                conn,
                run_id,
                principal.tenant_id,
                "CheckpointSaved",
                {"path": str(path), "version": copied.version,
                 "group": copied.model_package_group, "size_bytes": size,
                 "merged": copied.is_merged, "copied_from": str(source.path)},
                actor=principal.key_id,
            )  # fmt: skip
            return copied
    except BaseException:
        store.delete_prefix(prefix + "/")
        raise


def _check_destination(principal: Principal, request: CopyRequest) -> None:
    project = request.destination_project_id
    if project is not None and project != principal.tenant_id:
        raise ValidationError(
            f"destination_project_id {project!r} is not yours: in Treadle a tenant is its own "
            f"only project, so copy into {principal.tenant_id!r} (or omit it and pass "
            "session_id and model_seq_id)"
        )
    if (request.session_id is None) != (request.model_seq_id is None):
        raise ValidationError(
            "copy_weights needs session_id and model_seq_id together (the run the copy goes "
            "into), or neither (a new session holds the copy)"
        )
    if project is None and request.session_id is None:
        raise ValidationError(
            f"copy_weights needs destination_project_id ({principal.tenant_id!r}, your tenant) "
            "or session_id and model_seq_id"
        )


def _earlier_copy(
    conn: sa.Connection, principal: Principal, request_key: str | None
) -> checkpoints.Checkpoint | None:
    if request_key is None:
        return None
    path = conn.execute(
        sa.select(checkpoint_rows.c.tinker_path)
        .where(
            checkpoint_rows.c.tenant_id == principal.tenant_id,
            checkpoint_rows.c.copy_request_key == request_key,
        )
        .limit(1)
    ).scalar_one_or_none()
    if path is None:
        return None
    return checkpoints.get(conn, principal, path)  # a deleted copy is a 404, not a new copy


def _new_run(
    conn: sa.Connection,
    principal: Principal,
    request: CopyRequest,
    source: checkpoints.Checkpoint,
    source_session: sessions_core.SessionRow,
) -> str:
    """Create the stopped training run that holds the copy; returns its id."""
    if request.session_id is not None:
        assert request.model_seq_id is not None
        run_id = sessions_core.training_session_id(request.session_id, request.model_seq_id)
        if not _create_run(conn, principal, run_id, request.session_id, source, source_session):
            raise ValidationError(
                f"model {run_id} exists already; copy into an unused model_seq_id of session "
                f"{request.session_id}"
            )
        sessions_core.stop_session(conn, principal, run_id, COPY_REASON)
        return run_id
    client = sessions_core.create_client_session(
        conn, principal, [], {"copied_from": str(source.path)}, display_name="copy_weights"
    )
    run_id = sessions_core.training_session_id(client, 0)
    _create_run(conn, principal, run_id, client, source, source_session)
    sessions_core.finish_client_session(conn, principal, client, COPY_REASON)
    return run_id


def _create_run(
    conn: sa.Connection,
    principal: Principal,
    run_id: str,
    client_session_id: str,
    source: checkpoints.Checkpoint,
    source_session: sessions_core.SessionRow,
) -> bool:
    return sessions_core.create_session(
        conn,
        principal,
        session_id=run_id,
        client_session_id=client_session_id,
        kind=sessions_core.SessionKind.TRAINING,
        base_model=source_session.base_model,
        lora_config=source_session.lora_config,
        user_metadata={"copied_from": str(source.path)},
    )


def _copy_files(store: ObjectStore, source: checkpoints.Checkpoint, prefix: str) -> int:
    source_prefix = source.storage_prefix
    keys = store.list(source_prefix + "/")
    if not keys:
        raise ValidationError(
            f"the files of {source.path} are gone, so it cannot be copied; save it again"
        )
    folder = Path(tempfile.mkdtemp(prefix="treadle-copy-"))
    size = 0
    try:
        for key in keys:
            local = folder / "file"
            store.get_file(key, local)
            store.put_file(f"{prefix}/{key[len(source_prefix) + 1 :]}", local)
            size += local.stat().st_size
            local.unlink()
    except BaseException:
        store.delete_prefix(prefix + "/")
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return size
