"""A sampler's next seq_id, allocated in the database: `samplers.next_seq_id`.

The OpenAI-compatible routes (`api/routes_openai`) admit each request on a sampler of their
own with a seq_id taken by one atomic `UPDATE ... RETURNING`, so concurrent requests never
share one (the tinker SDK numbers its own samplers' requests itself and never reads this).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "samplers",
        sa.Column("next_seq_id", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("samplers", "next_seq_id")
