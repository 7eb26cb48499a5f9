"""Publishing checkpoints: which tenants besides its own may read a checkpoint.

Published, a checkpoint's tinker:// path may be read by keys of every tenant: loaded into a new
training session (`load_weights`), copied into their own tenant (`copy_weights`), its weights
info read, its files downloaded (external weights links, Treadle's file routes). Unpublished, it
is its own tenant's only, and another tenant's key gets the 404 a missing checkpoint gets. Only
keys of the owning tenant publish, unpublish, delete it or change its TTL. Publishing a public
checkpoint or unpublishing a private one changes nothing and succeeds (the SDK retries a 409 for
minutes). Owns `checkpoints.published_at` / `published_by`.
Imports nothing from api, engine, worker, Flask or torch.
"""

from __future__ import annotations

import sqlalchemy as sa

from treadle.platform.checkpoints import checkpoints
from treadle.platform.eventlog.schema import checkpoints as checkpoint_rows
from treadle.platform.tenancy.tenants import Principal


def publish(conn: sa.Connection, principal: Principal, path: str) -> checkpoints.Checkpoint:
    """Make the caller's tenant's checkpoint at `path` readable by every tenant."""
    return _set(conn, principal, path, public=True)


def unpublish(conn: sa.Connection, principal: Principal, path: str) -> checkpoints.Checkpoint:
    """Make the checkpoint at `path` its own tenant's only again."""
    return _set(conn, principal, path, public=False)


def get_readable(conn: sa.Connection, principal: Principal, path: str) -> checkpoints.Checkpoint:
    """The checkpoint at `path` if the caller's tenant owns it or it is published."""
    return checkpoints.get(conn, principal, path, readable=True)


def _set(
    conn: sa.Connection, principal: Principal, path: str, *, public: bool
) -> checkpoints.Checkpoint:
    checkpoint = checkpoints.get(conn, principal, path)  # the owner's only: 404 for any other
    if checkpoint.public == public:
        return checkpoint
    conn.execute(
        sa.update(checkpoint_rows)
        .where(
            checkpoint_rows.c.tinker_path == str(checkpoint.path),
            checkpoint_rows.c.tenant_id == principal.tenant_id,
            checkpoint_rows.c.deleted_at.is_(None),
        )
        .values(
            published_at=sa.func.now() if public else None,
            published_by=principal.key_id if public else None,
        )
    )
    return checkpoints.get(conn, principal, path)
