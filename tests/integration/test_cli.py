"""The `treadle` command's other verbs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory

from treadle.platform import db

pytestmark = pytest.mark.integration


def test_migrate_is_idempotent_and_leaves_schema_at_head(services, engine: sa.Engine) -> None:
    env = {**os.environ, "DATABASE_URL": services.database_url}
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    head = ScriptDirectory.from_config(db.alembic_config(services.database_url)).get_current_head()
    with engine.connect() as conn:
        version = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one()
    assert head is not None and version == head


def test_sessions_spread_over_workers(platform, engine: sa.Engine) -> None:
    from tests.integration.wire_client import WireClient

    client = WireClient(platform.base_url, platform.admin_key)
    models = [client.create_model() for _ in range(4)]
    with engine.connect() as conn:
        holders = (
            conn.execute(
                sa.text("SELECT DISTINCT worker_id FROM sessions WHERE id = ANY(:ids)"),
                {"ids": models},
            )
            .scalars()
            .all()
        )
    assert len(holders) == 2
