"""The model registry: the base models the operator registers, retires and every process reads.

Owns the `base_models` table and its events (`BaseModelRegistered`, `BaseModelRetired`, one
stream per model, `base_model:<name>`), the commands that write them (`register`, `retire`,
operator only, each one transaction) and `ModelRegistry`, a process's view of the built-in and
registered models. A registered entry never changes once written (a name is never reused, even
after it is retired), so the view caches entries by name; only whether a model is retired, and
the listing, are read afresh.
Imports `eventlog`, `tenancy` and the models package; never torch or transformers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from treadle.platform.errors import AlreadyExistsError, NotFoundError, ValidationError
from treadle.platform.eventlog.schema import base_models, events
from treadle.platform.models import catalog, model_files
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.tenancy.tenants import Principal, require_operator

__all__ = [
    "ModelRegistry",
    "RegisteredModel",
    "list_models",
    "register",
    "resolve_hub_folder",
    "retire",
    "stream_id",
]

# Hub-style "org/name": the hub-compatible routes serve a model's tokenizer under its name.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


@dataclass(frozen=True)
class RegisteredModel:
    """A model with its registry record (None for a built-in's times and actors)."""

    info: BaseModelInfo
    created_at: datetime | None = None
    created_by: str | None = None
    retired_at: datetime | None = None
    retired_by: str | None = None

    @property
    def is_retired(self) -> bool:
        return self.retired_at is not None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.info.to_json(),
            "builtin": self.info.is_builtin,
            "created_at": _iso(self.created_at),
            "created_by": self.created_by,
            "retired_at": _iso(self.retired_at),
            "retired_by": self.retired_by,
        }


def stream_id(name: str) -> str:
    """The event stream of base model `name`."""
    return f"base_model:{name}"


def register(
    conn: sa.Connection,
    principal: Principal,
    name: str,
    options: model_files.Options,
    *,
    path: str | None = None,
    hub_id: str | None = None,
    revision: str | None = None,
    gguf_file: str | None = None,
) -> RegisteredModel:
    """Register base model `name` from a local folder (`path`; with `gguf_file`, that GGUF file
    in it) or a hub id at a pinned `revision` found in this host's Hugging Face cache. Operator
    only; one transaction: the row and its event, or nothing. Raises ValidationError for a bad
    name or folder (see `model_files.inspect_folder` and `inspect_gguf`), AlreadyExistsError for
    a name already used."""
    require_operator(principal, "registering base models")
    _check_name(name)
    if (path is None) == (hub_id is None):
        raise ValidationError("give either path (a local folder) or hub_id with revision")
    if hub_id is not None:
        folder = resolve_hub_folder(hub_id, revision)
        revision = folder.name  # the snapshot's commit, whatever name the revision had
    else:
        assert path is not None
        if revision is not None:
            raise ValidationError("revision goes with hub_id; a local folder has none")
        folder = Path(path)
    if _taken(conn, name):
        raise AlreadyExistsError(_taken_message(name))
    if gguf_file is not None:
        if hub_id is not None:
            raise ValidationError("gguf_file goes with path (a folder holding the file)")
        info = model_files.inspect_gguf(name, folder, gguf_file, options)
    else:
        info = model_files.inspect_folder(name, folder, options, hub_id=hub_id, revision=revision)
    row = conn.execute(
        insert(base_models)
        .values(name=name, info=info.to_json(), created_by=principal.key_id)
        .on_conflict_do_nothing(index_elements=["name"])
        .returning(base_models)
    ).one_or_none()
    if row is None:  # registered meanwhile by a concurrent request
        raise AlreadyExistsError(_taken_message(name))
    _append(conn, principal, name, 1, "BaseModelRegistered", info.to_json())
    return _registered(row)


def retire(conn: sa.Connection, principal: Principal, name: str) -> RegisteredModel:
    """Refuse new sessions on registered model `name` from now on; sessions and checkpoints
    already on it keep working. Operator only; idempotent. Built-in models cannot be retired."""
    require_operator(principal, "retiring base models")
    if any(info.name == name for info in catalog.list_base_models()):
        raise ValidationError(f"{name} is built in and cannot be retired")
    row = conn.execute(
        sa.select(base_models).where(base_models.c.name == name).with_for_update()
    ).one_or_none()
    if row is None:
        raise NotFoundError(f"no registered base model {name!r}; `treadle models list` lists them")
    if row.retired_at is None:
        row = conn.execute(
            base_models.update()
            .where(base_models.c.name == name)
            .values(retired_at=sa.func.now(), retired_by=principal.key_id)
            .returning(base_models)
        ).one()
        _append(conn, principal, name, 2, "BaseModelRetired", {"name": name})
    return _registered(row)


def list_models(conn: sa.Connection, *, include_retired: bool = False) -> list[RegisteredModel]:
    """The built-in models, then the registered ones by name (retired ones if asked)."""
    query = sa.select(base_models).order_by(base_models.c.name)
    if not include_retired:
        query = query.where(base_models.c.retired_at.is_(None))
    return [RegisteredModel(info) for info in catalog.list_base_models()] + [
        _registered(row) for row in conn.execute(query)
    ]


def describe(conn: sa.Connection, name: str) -> RegisteredModel:
    """Model `name`, built-in or registered (retired included); ValidationError otherwise."""
    for info in catalog.list_base_models():
        if info.name == name:
            return RegisteredModel(info)
    row = conn.execute(sa.select(base_models).where(base_models.c.name == name)).one_or_none()
    if row is None:
        raise NotFoundError(_unknown_message(conn, name))
    return _registered(row)


def resolve_hub_folder(hub_id: str, revision: str | None) -> Path:
    """The folder of `hub_id` at `revision` in this host's Hugging Face cache (never the
    network). ValidationError saying how to fetch it when it is not there."""
    if not revision:
        raise ValidationError(
            f"hub_id {hub_id!r} needs a pinned revision (a commit id, tag or branch); the "
            "registry records the commit it resolves to"
        )
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(hub_id, revision=revision, local_files_only=True)
    except Exception as exc:  # noqa: BLE001  # not found, a malformed id or revision: all the same to the operator
        raise ValidationError(
            f"{hub_id} at revision {revision!r} is not in this host's Hugging Face cache "
            f"({type(exc).__name__}); fetch it first (`hf download {hub_id} --revision "
            f"{revision}`) where the API and the workers share HF_HOME"
        ) from None
    return Path(folder)


class ModelRegistry:
    """A process's view of the base models: built-ins, then the registry's rows (cached by
    name, since an entry never changes). Without a database only the built-ins exist."""

    def __init__(self, db: sa.Engine | None) -> None:
        self._db = db
        self._cache: dict[str, BaseModelInfo] = {
            info.name: info for info in catalog.list_base_models()
        }

    def get(self, name: str) -> BaseModelInfo:
        """Model `name`, retired or not (sessions already on it keep working); ValidationError
        listing the available names otherwise."""
        info = self._cache.get(name)
        if info is None:
            info = self._read(name).info
            self._cache[name] = info
        return info

    def require_active(self, name: str) -> BaseModelInfo:
        """Model `name` for a new session: ValidationError if unknown or retired."""
        if name in self._cache and self._cache[name].is_builtin:
            return self._cache[name]
        found = self._read(name)
        if found.is_retired:
            raise ValidationError(
                f"base model {name} was retired on {_iso(found.retired_at)}; new sessions "
                "cannot use it (GET /api/v1/treadle/base_models lists the models in service)"
            )
        self._cache[name] = found.info
        return found.info

    def active(self) -> list[BaseModelInfo]:
        """Every model a new session may use: built-ins first, then registered by name."""
        if self._db is None:
            return catalog.list_base_models()
        with self._db.connect() as conn:
            return [m.info for m in list_models(conn)]

    def for_tokenizer_repo(self, repo_id: str) -> BaseModelInfo | None:
        """The model whose tokenizer repo is `repo_id` (its own name first), or None."""
        found = catalog.base_model_for_tokenizer_repo(repo_id)
        if found is not None:
            return found
        try:
            return self.get(repo_id)
        except (ValidationError, NotFoundError):
            return None

    def _read(self, name: str) -> RegisteredModel:
        if self._db is None:
            return RegisteredModel(catalog.get_base_model(name))
        with self._db.connect() as conn:
            try:
                return describe(conn, name)
            except NotFoundError as exc:
                raise ValidationError(exc.message) from None


def _check_name(name: str) -> None:
    if not _NAME.match(name or ""):
        raise ValidationError(
            f"model name {name!r} must look like a hub id, 'org/name' (letters, digits, '.', "
            "'_', '-'; at most 96 characters each side)"
        )


def _taken(conn: sa.Connection, name: str) -> bool:
    if any(info.name == name for info in catalog.list_base_models()):
        return True
    query = sa.select(base_models.c.name).where(base_models.c.name == name)
    return conn.execute(query).first() is not None


def _taken_message(name: str) -> str:
    return (
        f"base model {name} is already registered (names are never reused, even once "
        "retired); choose another name"
    )


def _unknown_message(conn: sa.Connection, name: str) -> str:
    known = ", ".join(repr(m.info.name) for m in list_models(conn))
    return f"unknown base model {name!r}; choose one of: {known}"


def _append(
    conn: sa.Connection, principal: Principal, name: str, seq: int, type: str, data: Any
) -> None:
    conn.execute(
        events.insert().values(
            session_id=stream_id(name),
            seq=seq,
            type=type,
            data=json.loads(json.dumps(data)),
            tenant_id=principal.tenant_id,
            actor=principal.key_id,
        )
    )


def _registered(row: sa.Row[Any]) -> RegisteredModel:
    return RegisteredModel(
        BaseModelInfo.from_json(dict(row.info)),
        row.created_at,
        row.created_by,
        row.retired_at,
        row.retired_by,
    )


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()
