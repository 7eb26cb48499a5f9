"""Initial schema: tenants, keys, client sessions, workers, sessions, events, samplers, operations.

The events table is append-only, enforced by the database: a trigger refuses UPDATE, DELETE and
TRUNCATE.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def _ts(name: str, nullable: bool = False, default: bool = True) -> sa.Column:
    return sa.Column(
        name, sa.DateTime(timezone=True), nullable=nullable, server_default=NOW if default else None
    )


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        _ts("created_at"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("secret_hash", sa.Text, nullable=False),
        sa.Column("role", sa.Text, nullable=False),
        _ts("created_at"),
        _ts("revoked_at", nullable=True, default=False),
    )
    op.create_index("uq_api_keys_secret_hash", "api_keys", ["secret_hash"], unique=True)
    op.create_table(
        "client_sessions",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("tags", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("user_metadata", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("status", sa.Text, nullable=False),
        _ts("created_at"),
        _ts("heartbeat_at"),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.Text, primary_key=True),
        _ts("started_at"),
        _ts("heartbeat_at"),
        sa.Column("info", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column(
            "client_session_id", sa.Text, sa.ForeignKey("client_sessions.id"), nullable=False
        ),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("name", sa.Text),
        sa.Column("base_model", sa.Text, nullable=False),
        sa.Column("lora_config", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("user_metadata", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("worker_id", sa.Text),
        sa.Column("lease_epoch", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("last_applied_seq", sa.BigInteger, nullable=False, server_default="-1"),
        sa.Column("last_event_seq", sa.BigInteger, nullable=False, server_default="0"),
        _ts("created_at"),
        _ts("updated_at"),
    )
    op.create_index("ix_sessions_tenant", "sessions", ["tenant_id"])
    op.create_index("ix_sessions_worker", "sessions", ["worker_id"])
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("data", JSONB, nullable=False),
        sa.Column("blob_key", sa.Text),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("actor", sa.Text),
        _ts("created_at"),
        sa.UniqueConstraint("session_id", "seq", name="uq_events_session_seq"),
    )
    op.execute(
        """
        CREATE FUNCTION events_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'events is append-only: % is not allowed', TG_OP
                USING ERRCODE = 'insufficient_privilege';
        END;
        $$;
        CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events
            FOR EACH ROW EXECUTE FUNCTION events_refuse_change();
        CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
            FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change();
        """
    )
    op.create_table(
        "samplers",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column(
            "client_session_id", sa.Text, sa.ForeignKey("client_sessions.id"), nullable=False
        ),
        sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("base_model", sa.Text, nullable=False),
        sa.Column("snapshot_id", sa.Text),
        sa.Column("model_path", sa.Text),
        _ts("created_at"),
    )
    op.create_table(
        "operations",
        sa.Column("request_id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("sampler_id", sa.Text),
        sa.Column("seq_id", sa.BigInteger, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("payload_hash", sa.Text, nullable=False),
        sa.Column("request_position", sa.BigInteger, nullable=False),
        sa.Column("result", JSONB),
        sa.Column("error", JSONB),
        _ts("created_at"),
        _ts("completed_at", nullable=True, default=False),
    )
    op.create_index(
        "uq_operations_training_seq",
        "operations",
        ["session_id", "seq_id"],
        unique=True,
        postgresql_where=sa.text("sampler_id IS NULL"),
    )
    op.create_index(
        "uq_operations_sample_seq",
        "operations",
        ["sampler_id", "seq_id"],
        unique=True,
        postgresql_where=sa.text("sampler_id IS NOT NULL"),
    )


def downgrade() -> None:
    for table in ("operations", "samplers"):
        op.drop_table(table)
    op.execute("DROP TABLE events")  # the TRUNCATE trigger does not fire on DROP
    op.execute("DROP FUNCTION events_refuse_change()")
    for table in ("sessions", "workers", "client_sessions", "api_keys", "tenants"):
        op.drop_table(table)
