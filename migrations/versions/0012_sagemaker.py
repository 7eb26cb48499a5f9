"""SageMaker's training-session API: access key pairs on API keys (SigV4), named training
sessions, the runtime's operations (their kind and client token), model package groups and a
checkpoint's description.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("access_key_id", sa.Text))
    op.add_column("api_keys", sa.Column("secret_ciphertext", sa.Text))
    op.create_index(
        "uq_api_keys_access_key_id",
        "api_keys",
        ["access_key_id"],
        unique=True,
        postgresql_where=sa.text("access_key_id IS NOT NULL"),
    )
    op.add_column("checkpoints", sa.Column("description", sa.Text))
    op.create_table(
        "model_package_groups",
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), primary_key=True),
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("description", sa.Text),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("created_by", sa.Text),
    )
    op.create_table(
        "sagemaker_sessions",
        sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("attributes", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
    )
    op.create_index(
        "uq_sagemaker_sessions_live_name",
        "sagemaker_sessions",
        ["tenant_id", "name"],
        unique=True,
        postgresql_where=sa.text("deleted_at IS NULL"),
    )
    op.create_table(
        "sagemaker_operations",
        sa.Column("request_id", sa.Text, sa.ForeignKey("operations.request_id"), primary_key=True),
        sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("client_token", sa.Text),
    )
    op.create_index(
        "uq_sagemaker_operations_token",
        "sagemaker_operations",
        ["session_id", "client_token"],
        unique=True,
        postgresql_where=sa.text("client_token IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_table("sagemaker_operations")
    op.drop_table("sagemaker_sessions")
    op.drop_table("model_package_groups")
    op.drop_column("checkpoints", "description")
    op.drop_index("uq_api_keys_access_key_id", table_name="api_keys")
    op.drop_column("api_keys", "secret_ciphertext")
    op.drop_column("api_keys", "access_key_id")
