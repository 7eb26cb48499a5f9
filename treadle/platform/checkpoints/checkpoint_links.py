"""Download links of external weights checkpoints (`external_weights_urls`).

`issue` checks that the caller may read the checkpoint (its tenant's, or a published one) and
mints a random token good for TOKEN_TTL; only its SHA-256 is stored (`checkpoint_downloads`).
`redeem` answers, with no API key, while the token is live, the checkpoint is live (not deleted
or expired) and still readable by the tenant the token was issued to, so unpublishing a
checkpoint takes back the links of other tenants at once. Imports nothing from api, engine, worker,
Flask or torch.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

import sqlalchemy as sa

from treadle.platform.checkpoints import checkpoints, publishing
from treadle.platform.errors import NotFoundError, ValidationError
from treadle.platform.eventlog.schema import checkpoint_downloads
from treadle.platform.eventlog.schema import checkpoints as checkpoint_rows
from treadle.platform.tenancy.tenants import Principal

TOKEN_TTL = timedelta(hours=1)
MAX_TOKEN_LENGTH = 128


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


def issue(
    conn: sa.Connection, principal: Principal, path: str
) -> tuple[str, checkpoints.Checkpoint, datetime]:
    """(token, checkpoint, expiry) of a new link to an external weights checkpoint's files."""
    checkpoint = publishing.get_readable(conn, principal, path)
    if checkpoint.path.kind != "external_weights":
        raise ValidationError(
            f"{checkpoint.path} is not an external weights checkpoint: only "
            "tinker://<run id>/external_weights/<name> have download links; make one with "
            "TrainingClient.save_weights_external(name)"
        )
    row_id = conn.execute(
        sa.select(checkpoint_rows.c.id).where(
            checkpoint_rows.c.tinker_path == str(checkpoint.path),
            checkpoint_rows.c.deleted_at.is_(None),
        )
    ).scalar_one()
    conn.execute(  # the tenant's expired tokens: nothing can use them any more
        sa.delete(checkpoint_downloads).where(
            checkpoint_downloads.c.tenant_id == principal.tenant_id,
            checkpoint_downloads.c.expires_at < sa.func.now(),
        )
    )
    token = secrets.token_urlsafe(32)
    expires = conn.execute(
        checkpoint_downloads.insert()
        .values(
            token_hash=_hash(token),
            tenant_id=principal.tenant_id,
            checkpoint_id=row_id,
            created_by=principal.key_id,
            expires_at=sa.func.now() + TOKEN_TTL,
        )
        .returning(checkpoint_downloads.c.expires_at)
    ).scalar_one()
    return token, checkpoint, expires


def redeem(conn: sa.Connection, token: str) -> str:
    """The storage prefix of the checkpoint a live token names; NotFoundError otherwise."""
    prefix = None
    if len(token) <= MAX_TOKEN_LENGTH:  # a longer one was never issued: no need to look
        c, d = checkpoint_rows.c, checkpoint_downloads.c
        prefix = conn.execute(
            sa.select(c.storage_prefix)
            .select_from(checkpoint_downloads.join(checkpoint_rows, c.id == d.checkpoint_id))
            .where(
                d.token_hash == _hash(token),
                d.expires_at > sa.func.now(),
                c.deleted_at.is_(None),
                sa.or_(c.expires_at.is_(None), c.expires_at > sa.func.now()),
                sa.or_(c.tenant_id == d.tenant_id, c.published_at.is_not(None)),
            )
        ).scalar_one_or_none()
    if prefix is None:
        raise NotFoundError(
            "this download link is unknown or has expired (links last "
            f"{TOKEN_TTL.total_seconds() / 3600:g} hour, and end when the checkpoint is "
            "deleted or unpublished); ask for new ones: RestClient.get_external_weights_urls"
        )
    return str(prefix)
