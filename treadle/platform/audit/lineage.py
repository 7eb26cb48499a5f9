"""Replays and forks: new sessions built from another session's log.

- `open_replay`: a sandbox (kind `replay`: read-only to training calls, never billed) rebuilt
  from the source's log up to a seq_id, checking the state hashes after every state-changing
  operation against those recorded when it first ran; its first operation's result is the report.
- `open_fork`: a new training session of the caller (its tenant, its quota) equal to the source
  right after seq N, built from the source's newest recovery point at or before N plus a
  verified replay; `SessionForked(source, seq, state hashes)` heads its log. The source's log
  is never written to.
The worker does the rebuilding (a `Rebuild` payload as the new session's seq 0).
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import events
from treadle.platform.eventlog.optypes import LoraConfig, OpStatus, Rebuild, RebuildMode
from treadle.platform.eventlog.results import RebuildOutput
from treadle.platform.eventlog.schema import operations as operation_rows
from treadle.platform.operations import commands, operations
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.sessions.sessions import SessionKind, SessionRow
from treadle.platform.tenancy.tenants import Principal


def open_replay(
    deps: commands.Deps,
    principal: Principal,
    *,
    source_id: str,
    client_session_id: str,
    model_seq_id: int,
    to_seq: int | None = None,
) -> operations.Admission:
    """Open a replay of `source_id` up to `to_seq` (default: all it applied) in the caller's
    client session. Raises NotFoundError for another tenant's or a missing session,
    ValidationError for a seq_id it never reached."""
    with deps.db.connect() as conn:
        source = _source(conn, principal, source_id)
    seq = source.last_applied_seq if to_seq is None else to_seq
    _check_seq(source, seq, "to_seq", "replay")
    return _open(
        deps, principal, source, seq, RebuildMode.REPLAY,
        client_session_id=client_session_id, model_seq_id=model_seq_id,
        kind=SessionKind.REPLAY, name=None,
        head=("ReplayRequested", {"source_session_id": source.id, "to_seq": seq}),
    )  # fmt: skip


def open_fork(
    deps: commands.Deps,
    principal: Principal,
    *,
    source_id: str,
    client_session_id: str,
    model_seq_id: int,
    at_seq: int,
    name: str | None = None,
) -> operations.Admission:
    """Open a fork of `source_id` as it stood right after `at_seq`, in the caller's client
    session. Raises NotFoundError, ValidationError (a seq_id it never reached), or the quota
    errors of any new training session."""
    with deps.db.connect() as conn:
        source = _source(conn, principal, source_id)
        _check_seq(source, at_seq, "at_seq", "fork")
        state = recorded_state(conn, source.id, at_seq)
    return _open(
        deps, principal, source, at_seq, RebuildMode.FORK,
        client_session_id=client_session_id, model_seq_id=model_seq_id,
        kind=SessionKind.TRAINING, name=sessions_core.ensure_valid_name(name),
        head=("SessionForked", {"source_session_id": source.id, "source_seq": at_seq,
                                "state": state}),
    )  # fmt: skip


def _open(
    deps: commands.Deps,
    principal: Principal,
    source: SessionRow,
    seq: int,
    mode: RebuildMode,
    *,
    client_session_id: str,
    model_seq_id: int,
    kind: SessionKind,
    name: str | None,
    head: tuple[str, dict[str, Any]],
) -> operations.Admission:
    model_id = sessions_core.training_session_id(client_session_id, model_seq_id)
    if model_id == source.id:
        raise ValidationError(f"model_seq_id {model_seq_id} names the source session itself")
    lora = LoraConfig(**source.lora_config)

    def append_head(conn: sa.Connection) -> None:
        if events.read_stream(conn, model_id, types=(head[0],)):
            return  # a resent request: its head is written already
        events.append(conn, model_id, principal.tenant_id, head[0], head[1],
                      actor=principal.key_id)  # fmt: skip

    admission = commands.open_session(
        deps, principal,
        session_id=model_id, client_session_id=client_session_id, kind=kind,
        base_model=source.base_model,
        first=Rebuild(source_session_id=source.id, to_seq=seq, mode=mode,
                      base_model=source.base_model, lora_config=lora),
        with_session=append_head,
        name=name, lora_config=dict(source.lora_config),
        source_session_id=source.id, source_seq=seq,
    )  # fmt: skip
    assert admission is not None, "a rebuild is always the first operation"
    return admission


def _source(conn: sa.Connection, principal: Principal, source_id: str) -> SessionRow:
    source = sessions_core.get_session(conn, principal, source_id)
    if source.kind != SessionKind.TRAINING:
        raise ValidationError(
            f"{source_id} is a {source.kind} session; only training sessions (forks included) "
            "have a training log to replay or fork; use its source, "
            f"{source.source_session_id or 'a training session'}, instead"
        )
    return source


def _check_seq(source: SessionRow, seq: int, field: str, verb: str) -> None:
    if source.last_applied_seq < 0:
        raise ValidationError(
            f"{source.id} has applied no operation yet; wait for its create_model to complete "
            f"before you {verb} it"
        )
    if not 0 <= seq <= source.last_applied_seq:
        raise ValidationError(
            f"{field} must be between 0 and {source.last_applied_seq} ({source.id} has applied "
            f"operations up to seq {source.last_applied_seq}), got {seq}"
        )


def recorded_state(conn: sa.Connection, session_id: str, at_seq: int) -> dict[str, str]:
    """The state hashes recorded for `session_id` right after `at_seq`: for each part (weights,
    grads, optimizer), the hash its last state-changing operation at or before it recorded."""
    rows = conn.execute(
        sa.select(operation_rows.c.state)
        .where(
            operation_rows.c.session_id == session_id,
            operation_rows.c.sampler_id.is_(None),
            operation_rows.c.seq_id <= at_seq,
            operation_rows.c.status == OpStatus.COMPLETED,
            # a JSON null is stored for operations that record no state
            sa.func.jsonb_typeof(operation_rows.c.state) == "object",
        )
        .order_by(operation_rows.c.seq_id.desc())
        .limit(64)
    ).scalars()
    state: dict[str, str] = {}
    for recorded in rows:
        for part, digest in recorded.items():
            state.setdefault(part, digest)
        if {"weights", "grads", "optimizer"} <= state.keys():
            break
    return state


def report(conn: sa.Connection, principal: Principal, model_id: str) -> dict[str, Any]:
    """How a replay's or fork's rebuild went: `status` is running, matched, diverged or failed
    (with the error); matched and diverged carry the report the worker wrote."""
    session = sessions_core.get_session(conn, principal, model_id)
    if session.source_session_id is None:
        raise ValidationError(
            f"{model_id} is neither a replay nor a fork; open one with `treadle replay` or "
            "`treadle fork`"
        )
    first = operations.training_op_at(conn, model_id, 0)
    head: dict[str, Any] = {
        "model_id": model_id,
        "kind": session.kind,
        "source_session_id": session.source_session_id,
        "source_seq": session.source_seq,
        "session_status": session.status,
    }
    if first is None or first.status == OpStatus.PENDING:
        return {**head, "status": "running"}
    if first.status == OpStatus.FAILED:
        return {**head, "status": "failed", "error": first.error["message"]}
    rebuilt = dict(RebuildOutput.model_validate(first.result).report)
    return {**head, "status": "matched" if rebuilt["matched"] else "diverged", **rebuilt}
