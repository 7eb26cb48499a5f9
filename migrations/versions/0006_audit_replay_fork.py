"""Audit, replay and fork.

- `client_sessions.created_by`: the key that opened the client session (its owner in listings);
  `display_name`: the label the SDK gives it (searchable).
- `sessions.source_session_id` / `source_seq`: a replay or a fork is built from another
  session's log up to that seq_id (NULL for an ordinary session); `ix_sessions_source` finds a
  session's replays and forks.
- `trace_exports`: download tokens of `GET /api/v1/sessions/<id>/trace_export` (only the
  SHA-256 of a token is stored; it answers until `expires_at`, with no API key).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.add_column("client_sessions", sa.Column("created_by", sa.Text))
    op.add_column("client_sessions", sa.Column("display_name", sa.Text))
    op.add_column("sessions", sa.Column("source_session_id", sa.Text))
    op.add_column("sessions", sa.Column("source_seq", sa.BigInteger))
    op.create_index("ix_sessions_source", "sessions", ["source_session_id"])
    op.create_index("ix_sessions_tenant_created", "sessions", ["tenant_id", "created_at"])
    op.create_index(
        "ix_client_sessions_tenant_created", "client_sessions", ["tenant_id", "created_at"]
    )
    op.create_table(
        "trace_exports",
        sa.Column("token_hash", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column(
            "client_session_id", sa.Text, sa.ForeignKey("client_sessions.id"), nullable=False
        ),
        sa.Column("created_by", sa.Text),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("trace_exports")
    op.drop_index("ix_client_sessions_tenant_created", table_name="client_sessions")
    op.drop_index("ix_sessions_tenant_created", table_name="sessions")
    op.drop_index("ix_sessions_source", table_name="sessions")
    op.drop_column("sessions", "source_seq")
    op.drop_column("sessions", "source_session_id")
    op.drop_column("client_sessions", "display_name")
    op.drop_column("client_sessions", "created_by")
