"""Pending operations found without reading the whole `operations` table.

`ix_operations_pending`: a partial index on the few pending rows, by session and admission
time. The lease keeper looks up its sessions' stalled operations every second, each worker's
metrics read its queue depth at every scrape, and `treadle status` counts the pending ones and
finds the oldest; without it each of those reads every operation ever admitted.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_operations_pending",
        "operations",
        ["session_id", "created_at"],
        postgresql_where=sa.text("status = 'pending'"),
    )


def downgrade() -> None:
    op.drop_index("ix_operations_pending", table_name="operations")
