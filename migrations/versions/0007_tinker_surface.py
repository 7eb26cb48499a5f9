"""The rest of the Tinker surface: published checkpoints, copies, external weights downloads and
sampling-session clones.

- `checkpoints.published_at` / `published_by`: a published checkpoint (NULL: private) may be
  read by keys of any tenant (loaded, copied, its weights info and files); only its own
  tenant's keys publish, unpublish or delete it.
- `checkpoints.copied_from` / `copy_request_key`: a checkpoint made by `copy_weights`, the path
  it was copied from and the request's idempotency key (`uq_checkpoints_copy_request`: a resent
  copy answers the first one's path instead of copying again).
- `checkpoint_downloads`: the one-hour tokens of `external_weights_urls` links (only a token's
  SHA-256 is stored; a link answers, with no API key, while the checkpoint is live and readable
  by the tenant it was issued to).
- `samplers.clients_joined`: how many clones have joined a sampling session
  (`join_sampling_session` hands out the next number; the original client is 0).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("published_at", sa.DateTime(timezone=True)))
    op.add_column("checkpoints", sa.Column("published_by", sa.Text))
    op.add_column("checkpoints", sa.Column("copied_from", sa.Text))
    op.add_column("checkpoints", sa.Column("copy_request_key", sa.Text))
    op.create_index(
        "uq_checkpoints_copy_request",
        "checkpoints",
        ["tenant_id", "copy_request_key"],
        unique=True,
        postgresql_where=sa.text("copy_request_key IS NOT NULL"),
    )
    op.add_column(
        "samplers",
        sa.Column("clients_joined", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.create_table(
        "checkpoint_downloads",
        sa.Column("token_hash", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("checkpoint_id", sa.BigInteger, sa.ForeignKey("checkpoints.id"), nullable=False),
        sa.Column("created_by", sa.Text),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("checkpoint_downloads")
    op.drop_column("samplers", "clients_joined")
    op.drop_index("uq_checkpoints_copy_request", table_name="checkpoints")
    op.drop_column("checkpoints", "copy_request_key")
    op.drop_column("checkpoints", "copied_from")
    op.drop_column("checkpoints", "published_by")
    op.drop_column("checkpoints", "published_at")
