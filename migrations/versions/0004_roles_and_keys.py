"""Roles and keys: the operator role, disabled tenants, key names, creators, revokers, last use.

- `tenants.disabled_at`: a disabled tenant's keys are refused until the operator enables it.
- `api_keys.role` may now be `operator` (the key seeded from TREADLE_ADMIN_KEY; `create_app`
  upgrades that key's existing row at startup), `admin` or `member`, checked by the database.
- `api_keys.name`, `created_by`, `revoked_by` (key ids) and `last_used_at` (refreshed at most
  once a minute), and an index to list a tenant's keys.

Existing keys keep working: their hashes are unchanged.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("disabled_at", sa.DateTime(timezone=True)))
    op.add_column("api_keys", sa.Column("name", sa.Text))
    op.add_column("api_keys", sa.Column("created_by", sa.Text))
    op.add_column("api_keys", sa.Column("last_used_at", sa.DateTime(timezone=True)))
    op.add_column("api_keys", sa.Column("revoked_by", sa.Text))
    op.create_check_constraint(
        "ck_api_keys_role", "api_keys", "role IN ('operator', 'admin', 'member')"
    )
    op.create_index("ix_api_keys_tenant", "api_keys", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_api_keys_tenant", table_name="api_keys")
    op.drop_constraint("ck_api_keys_role", "api_keys", type_="check")
    op.execute("UPDATE api_keys SET role = 'admin' WHERE role = 'operator'")
    op.drop_column("api_keys", "revoked_by")
    op.drop_column("api_keys", "last_used_at")
    op.drop_column("api_keys", "created_by")
    op.drop_column("api_keys", "name")
    op.drop_column("tenants", "disabled_at")
