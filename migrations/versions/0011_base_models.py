"""The model registry: `base_models`, one row per base model the operator registered
(platform/models/registry.py); the built-in models are not rows.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "base_models",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("info", JSONB, nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.Column("created_by", sa.Text),
        sa.Column("retired_at", sa.DateTime(timezone=True)),
        sa.Column("retired_by", sa.Text),
    )


def downgrade() -> None:
    op.drop_table("base_models")
