"""Checkpoints: the registry of saved weights, versioned per model package group.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("model_package_group", sa.Text))
    op.add_column("samplers", sa.Column("checkpoint_prefix", sa.Text))
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("tinker_path", sa.Text, nullable=False),
        sa.Column("storage_prefix", sa.Text, nullable=False),
        sa.Column("model_package_group", sa.Text, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("has_optimizer", sa.Boolean, nullable=False),
        sa.Column("is_merged", sa.Boolean, nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True)),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
        sa.UniqueConstraint(
            "tenant_id", "model_package_group", "version", name="uq_checkpoints_version"
        ),
    )
    op.create_index("ix_checkpoints_tenant", "checkpoints", ["tenant_id"])
    op.create_index(
        "uq_checkpoints_live_path",
        "checkpoints",
        ["tinker_path"],
        unique=True,
        postgresql_where=sa.text("deleted_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_table("checkpoints")
    op.drop_column("samplers", "checkpoint_prefix")
    op.drop_column("sessions", "model_package_group")
