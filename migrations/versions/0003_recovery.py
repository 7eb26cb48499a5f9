"""Recovery: recorded state hashes, automatic checkpoints and refused seq_ids.

- `operations.state`: the adapter's state hashes recorded when a state-changing operation
  completed; replay checks each replayed step against them.
- `auto_checkpoints`: the platform's own checkpoints of a session (every N optimizer steps, and a
  copy of every checkpoint it loads), so recovery loads the newest and replays only what follows,
  and never depends on files a user can delete.
- `refused_seqs`: seq_ids whose request was refused at admission, so the worker moves past them
  at once instead of waiting for a request that will never come.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("operations", sa.Column("state", JSONB))
    op.create_table(
        "auto_checkpoints",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("seq_id", sa.BigInteger, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("storage_prefix", sa.Text, nullable=False),
        sa.Column("state", JSONB, nullable=False),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
    )
    op.create_index(
        "uq_auto_checkpoints_live_seq",
        "auto_checkpoints",
        ["session_id", "seq_id"],
        unique=True,
        postgresql_where=sa.text("deleted_at IS NULL"),
    )
    op.create_table(
        "refused_seqs",
        sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), primary_key=True),
        sa.Column("seq_id", sa.BigInteger, primary_key=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
    )


def downgrade() -> None:
    op.drop_table("refused_seqs")
    op.drop_table("auto_checkpoints")
    op.drop_column("operations", "state")
