"""A read-only, Hugging Face hub-compatible view of the tokenizers Treadle serves, under `/hf`.

With `HF_ENDPOINT=<treadle>/hf`, hub clients load the tokenizer of every catalogue model without
huggingface.co: `AutoTokenizer.from_pretrained(repo)`, `hf_hub_download(repo, file)`, the tinker
SDK's `get_tokenizer()` and cookbook recipes. A repo is a model's own name ("treadle/tiny-debug")
or its tokenizer repo (get_info's `tokenizer_id`); both hold the same files.
Routes, the ones huggingface_hub calls to download: model info (at `main` or at a revision), the
file tree, and `resolve/<revision>/<file>` (GET and HEAD, byte ranges) with the headers hub
clients require: ETag (the file's git blob sha1), X-Repo-Commit (a commit id derived from the
files) and Content-Length. Errors carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound,
EntryNotFound) so clients raise their usual exceptions.
Public, no API key (docs/tinker-compatibility.md, "Cookbook"): the files are the same public
tokenizer files huggingface.co serves, hub clients send no X-API-Key, and nothing else (weights,
checkpoints, anything of a tenant) is served here.
Imports platform only; never torch or transformers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Response, jsonify, request

from treadle.api.context import services
from treadle.platform.models import tokenizers

bp = Blueprint("hf", __name__, url_prefix="/hf")

MAIN = "main"


@dataclass(frozen=True)
class _File:
    name: str
    content: bytes

    @property
    def blob_id(self) -> str:
        """The file's git blob sha1: what the hub sends as a (non-LFS) file's ETag and oid."""
        header = f"blob {len(self.content)}\0".encode()
        return hashlib.sha1(header + self.content, usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class _Snapshot:
    """A repo at its only revision: its files and a commit id that changes when they do."""

    repo_id: str
    files: tuple[_File, ...]

    @property
    def commit(self) -> str:
        listing = "".join(f"{f.name}\0{f.blob_id}\n" for f in self.files)
        return hashlib.sha1(listing.encode(), usedforsecurity=False).hexdigest()

    def file(self, name: str) -> _File | None:
        return next((f for f in self.files if f.name == name), None)


@bp.get("/api/models/<org>/<name>")
def model_info(org: str, name: str) -> Any:
    return _model_info(_snapshot(f"{org}/{name}"))


@bp.get("/api/models/<org>/<name>/revision/<revision>")
def model_info_at_revision(org: str, name: str, revision: str) -> Any:
    snapshot = _snapshot(f"{org}/{name}")
    _check_revision(snapshot, revision)
    return _model_info(snapshot)


@bp.get("/api/models/<org>/<name>/tree/<revision>")
def tree(org: str, name: str, revision: str) -> Any:
    snapshot = _snapshot(f"{org}/{name}")
    _check_revision(snapshot, revision)
    return jsonify(
        [
            {"type": "file", "oid": f.blob_id, "size": len(f.content), "path": f.name}
            for f in snapshot.files
        ]
    )


@bp.get("/api/models/<org>/<name>/tree/<revision>/<path:path>")
def tree_path(org: str, name: str, revision: str, path: str) -> Any:
    snapshot = _snapshot(f"{org}/{name}")
    _check_revision(snapshot, revision)
    # The repos are flat: no folder exists (transformers asks for additional_chat_templates/).
    raise _HubError(
        "EntryNotFound",
        f"{snapshot.repo_id} has no folder {path!r} at {revision}; it holds only the files "
        f"{[f.name for f in snapshot.files]}",
        commit=snapshot.commit,
    )


@bp.get("/<org>/<name>/resolve/<revision>/<path:filename>")
def resolve(org: str, name: str, revision: str, filename: str) -> Any:
    snapshot = _snapshot(f"{org}/{name}")
    _check_revision(snapshot, revision)
    found = snapshot.file(filename)
    if found is None:
        raise _HubError(
            "EntryNotFound",
            f"{snapshot.repo_id} has no file {filename!r}; it holds only the tokenizer files "
            f"{[f.name for f in snapshot.files]}",
            commit=snapshot.commit,
        )
    response = Response(found.content, mimetype="application/octet-stream")
    response.set_etag(found.blob_id)
    response.headers["X-Repo-Commit"] = snapshot.commit
    # A Range request (a resumed download) gets 206 and its slice; HEAD the headers only.
    return response.make_conditional(
        request, accept_ranges=True, complete_length=len(found.content)
    )


class _HubError(Exception):
    """A 404 in the hub's terms: `X-Error-Code` makes huggingface_hub raise RepositoryNotFound,
    RevisionNotFound or EntryNotFound; the body is Treadle's usual error."""

    def __init__(self, code: str, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.commit = code, message, commit


@bp.errorhandler(_HubError)
def hub_error(exc: _HubError) -> Any:
    response = jsonify(error={"code": exc.code, "message": exc.message})
    response.status_code = 404
    response.headers["X-Error-Code"] = exc.code
    response.headers["X-Error-Message"] = exc.message
    if exc.commit is not None:  # lets hub clients remember that the file does not exist
        response.headers["X-Repo-Commit"] = exc.commit
    return response


def _snapshot(repo_id: str) -> _Snapshot:
    info = services().models.for_tokenizer_repo(repo_id)
    if info is None:
        raise _HubError(
            "RepoNotFound",
            f"no tokenizer repo {repo_id!r} on this Treadle; it serves each base model's "
            "tokenizer under the model's name (GET /api/v1/treadle/base_models lists them)",
        )
    files = tokenizers.tokenizer_files(info, services().config.cache_dir)
    return _Snapshot(repo_id, tuple(_File(n, c) for n, c in sorted(files.items())))


def _check_revision(snapshot: _Snapshot, revision: str) -> None:
    if revision not in (MAIN, snapshot.commit):
        raise _HubError(
            "RevisionNotFound",
            f"{snapshot.repo_id} has no revision {revision!r}; use {MAIN!r} or its current "
            f"commit {snapshot.commit}",
        )


def _model_info(snapshot: _Snapshot) -> Any:
    org = snapshot.repo_id.split("/", 1)[0]
    return jsonify(
        _id=snapshot.repo_id,
        id=snapshot.repo_id,
        modelId=snapshot.repo_id,
        author=org,
        sha=snapshot.commit,
        private=False,
        gated=False,
        disabled=False,
        library_name="transformers",
        tags=["tokenizer", "treadle"],
        siblings=[
            {"rfilename": f.name, "size": len(f.content), "blobId": f.blob_id}
            for f in snapshot.files
        ],
    )
