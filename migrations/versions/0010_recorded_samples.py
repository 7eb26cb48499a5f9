"""Recorded samples: `recorded_samples`, one row per sample requested with
record_stability_info, so training data's provenance can name its sequences and the
stable_reinforce loss can read the sampler's own logprobs (platform/operations/recorded_samples.py).

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "recorded_samples",
        sa.Column("request_id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id")),
        sa.Column(
            "client_session_id", sa.Text, sa.ForeignKey("client_sessions.id"), nullable=False
        ),
        sa.Column("sampler_id", sa.Text, nullable=False),
        sa.Column("snapshot_id", sa.Text),
        sa.Column("model_path", sa.Text),
        sa.Column("weights_seq", sa.BigInteger),
        sa.Column("prompt", JSONB, nullable=False),
        sa.Column("num_samples", sa.Integer, nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.Column(
            "last_used_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_recorded_samples_expires", "recorded_samples", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_recorded_samples_expires", table_name="recorded_samples")
    op.drop_table("recorded_samples")
