"""Metering, billing and quotas: prices, the usage ledger, reservations, quotas and spend caps.

- `prices`: USD per million tokens (stored as integer micro-dollars) per base model and token
  class, versioned by the time each takes effect.
- `usage`: exactly one row per completed operation (unique by request id), with its tokens by
  class and its cost at the price in force when it completed.
- `reservations`: the most an admitted operation can cost, held against its tenant's monthly
  budget (and its session's cap) until it settles, fails or is stopped.
- `tenant_months`: per tenant and calendar month, what is settled and what is reserved, the row
  every admission of the tenant locks, so a budget is never overspent under concurrency.
- `quotas`: per tenant limits. `sessions.max_cost_micro_usd` / `spent_micro_usd` /
  `reserved_micro_usd`: a session's spend cap and what it has spent and holds.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("base_model", sa.Text, nullable=False),
        sa.Column("token_class", sa.Text, nullable=False),
        sa.Column("micro_usd_per_million", sa.BigInteger, nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.Text),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.CheckConstraint("micro_usd_per_million >= 0", name="ck_prices_not_negative"),
        sa.CheckConstraint(
            "token_class IN ('prefill', 'sample', 'train')", name="ck_prices_token_class"
        ),
    )
    op.create_index(
        "ix_prices_model_class_from", "prices", ["base_model", "token_class", "effective_from"]
    )
    op.create_table(
        "usage",
        sa.Column("request_id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("sampler_id", sa.Text),
        sa.Column("actor", sa.Text),
        sa.Column("base_model", sa.Text, nullable=False),
        sa.Column("op_type", sa.Text, nullable=False),
        sa.Column("prefill_tokens", sa.BigInteger, nullable=False),
        sa.Column("prefill_price", sa.BigInteger),  # micro-USD per million; NULL: unpriced
        sa.Column("prefill_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("sample_tokens", sa.BigInteger, nullable=False),
        sa.Column("sample_price", sa.BigInteger),  # micro-USD per million; NULL: unpriced
        sa.Column("sample_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("train_tokens", sa.BigInteger, nullable=False),
        sa.Column("train_price", sa.BigInteger),  # micro-USD per million; NULL: unpriced
        sa.Column("train_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("cost_micro_usd", sa.BigInteger, nullable=False),
        sa.Column("unpriced", sa.Boolean, nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )
    op.create_index("ix_usage_tenant_completed", "usage", ["tenant_id", "completed_at"])
    op.create_index("ix_usage_session", "usage", ["session_id"])
    op.create_table(
        "reservations",
        sa.Column("request_id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("month", sa.Date, nullable=False),
        sa.Column("micro_usd", sa.BigInteger, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )
    op.create_index("ix_reservations_session", "reservations", ["session_id"])
    op.create_table(
        "tenant_months",
        sa.Column("tenant_id", sa.Text, primary_key=True),
        sa.Column("month", sa.Date, primary_key=True),
        sa.Column("settled_micro_usd", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("settled_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("reserved_micro_usd", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("reserved_tokens", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.create_table(
        "quotas",
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), primary_key=True),
        sa.Column("monthly_micro_usd", sa.BigInteger),
        sa.Column("monthly_tokens", sa.BigInteger),
        sa.Column("max_sessions", sa.Integer),
        sa.Column("requests_per_second", sa.Float),
        sa.Column("max_request_tokens", sa.BigInteger),
        sa.Column("updated_by", sa.Text),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )
    op.add_column("operations", sa.Column("actor", sa.Text))
    op.add_column("sessions", sa.Column("max_cost_micro_usd", sa.BigInteger))
    op.add_column(
        "sessions",
        sa.Column("spent_micro_usd", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.add_column(
        "sessions",
        sa.Column("reserved_micro_usd", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("sessions", "reserved_micro_usd")
    op.drop_column("sessions", "spent_micro_usd")
    op.drop_column("sessions", "max_cost_micro_usd")
    op.drop_column("operations", "actor")
    op.drop_table("quotas")
    op.drop_table("tenant_months")
    op.drop_table("reservations")
    op.drop_table("usage")
    op.drop_table("prices")
