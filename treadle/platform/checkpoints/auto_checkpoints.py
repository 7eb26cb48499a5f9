"""Automatic checkpoints: the platform's own recovery points of a training session.

A worker writes one every N optimizer steps ("auto"), and one after every checkpoint a session
loads ("loaded": a copy, so recovery never depends on a file the user can delete or that
expires). Each records the seq_id whose state it holds and that state's hashes; recovery loads the
newest one at or before the seq it rebuilds, checks the hashes, and replays only what follows.
Only the newest `keep` automatic ones are kept; loaded ones are kept for the session's life.
Files live under the tenant's prefix, built here. Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from treadle.platform.checkpoints import storage
from treadle.platform.eventlog import events
from treadle.platform.eventlog.schema import auto_checkpoints

AUTO = "auto"
LOADED = "loaded"


@dataclass(frozen=True)
class AutoCheckpoint:
    session_id: str
    seq_id: int  # the last applied seq_id whose state it holds
    kind: str
    storage_prefix: str
    state: Mapping[str, str]  # state part -> hash, as the engine computes them
    size_bytes: int


def storage_prefix(tenant_id: str, session_id: str, seq_id: int) -> str:
    return storage.tenant_key(tenant_id, "sessions", session_id, "recovery", f"{seq_id:012d}")


def record(
    conn: sa.Connection,
    *,
    tenant_id: str,
    checkpoint: AutoCheckpoint,
) -> None:
    """Register a written recovery point (appends AutoCheckpointSaved). The caller holds the
    session's lease; a point already recorded at that seq_id is replaced."""
    conn.execute(
        sa.update(auto_checkpoints)
        .where(
            auto_checkpoints.c.session_id == checkpoint.session_id,
            auto_checkpoints.c.seq_id == checkpoint.seq_id,
            auto_checkpoints.c.deleted_at.is_(None),
        )
        .values(deleted_at=sa.func.now())
    )
    conn.execute(
        auto_checkpoints.insert().values(
            tenant_id=tenant_id,
            session_id=checkpoint.session_id,
            seq_id=checkpoint.seq_id,
            kind=checkpoint.kind,
            storage_prefix=checkpoint.storage_prefix,
            state=dict(checkpoint.state),
            size_bytes=checkpoint.size_bytes,
        )
    )
    events.append(
        conn,
        checkpoint.session_id,
        tenant_id,
        "AutoCheckpointSaved",
        {
            "seq_id": checkpoint.seq_id,
            "kind": checkpoint.kind,
            "state": dict(checkpoint.state),
            "size_bytes": checkpoint.size_bytes,
        },
    )


def newest_first(
    conn: sa.Connection, session_id: str, *, at_or_before: int
) -> list[AutoCheckpoint]:
    """The session's live recovery points holding seq_id <= `at_or_before`, newest first."""
    rows = conn.execute(
        sa.select(auto_checkpoints)
        .where(
            auto_checkpoints.c.session_id == session_id,
            auto_checkpoints.c.seq_id <= at_or_before,
            auto_checkpoints.c.deleted_at.is_(None),
        )
        .order_by(auto_checkpoints.c.seq_id.desc())
    )
    return [_point(r) for r in rows]


def prune(conn: sa.Connection, session_id: str, keep: int) -> list[str]:
    """Mark all but the newest `keep` automatic points deleted; returns their storage prefixes
    (the caller deletes the files after commit). Loaded points are never pruned."""
    rows = conn.execute(
        sa.select(auto_checkpoints.c.id, auto_checkpoints.c.storage_prefix)
        .where(
            auto_checkpoints.c.session_id == session_id,
            auto_checkpoints.c.kind == AUTO,
            auto_checkpoints.c.deleted_at.is_(None),
        )
        .order_by(auto_checkpoints.c.seq_id.desc())
        .offset(keep)
    ).all()
    if rows:
        conn.execute(
            sa.update(auto_checkpoints)
            .where(auto_checkpoints.c.id.in_([r.id for r in rows]))
            .values(deleted_at=sa.func.now())
        )
    return [r.storage_prefix for r in rows]


def _point(row: sa.Row[Any]) -> AutoCheckpoint:
    return AutoCheckpoint(
        session_id=row.session_id,
        seq_id=row.seq_id,
        kind=row.kind,
        storage_prefix=row.storage_prefix,
        state=row.state,
        size_bytes=row.size_bytes,
    )
