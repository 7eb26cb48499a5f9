"""The `treadle` command's other verbs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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


def _active_per_worker(engine: sa.Engine) -> tuple[dict[str, int], int]:
    """Active sessions per live worker, and how many active sessions no worker holds yet."""
    with engine.connect() as conn:
        live = conn.execute(
            sa.text("SELECT id FROM workers WHERE heartbeat_at > now() - interval '10 seconds'")
        ).scalars()
        load = dict.fromkeys(live, 0)
        rows = conn.execute(
            sa.text(
                "SELECT worker_id, count(*) FROM sessions "
                "WHERE status IN ('Created', 'Running') GROUP BY worker_id"
            )
        ).all()
    unleased = sum(n for worker, n in rows if worker is None)
    load.update({worker: n for worker, n in rows if worker in load})
    return load, unleased


def test_each_new_session_goes_to_the_least_loaded_worker(platform, engine: sa.Engine) -> None:
    from tests.integration.wire_client import WireClient

    client = WireClient(platform.base_url, platform.admin_key)
    for _ in range(4):
        deadline = time.monotonic() + 30
        while (state := _active_per_worker(engine))[1] and time.monotonic() < deadline:
            time.sleep(0.2)  # sessions other tests left unleased are being claimed
        load, _ = state
        assert len(load) == 2, load
        model = client.create_model()
        with engine.connect() as conn:
            holder = conn.execute(
                sa.text("SELECT worker_id FROM sessions WHERE id = :id"), {"id": model}
            ).scalar_one()
        assert load[holder] == min(load.values()), (holder, load)
        client.post(f"treadle/sessions/{model}/stop", {})


def test_embedded_redis_starts_in_a_data_dir_given_relative(tmp_path, monkeypatch) -> None:
    """`treadle up --data-dir data` names a relative directory; redis-server changes into it
    before it opens its log, so the path must be made absolute first."""
    import redis

    from treadle.platform.embedded import EmbeddedRedis

    monkeypatch.chdir(tmp_path)
    server = EmbeddedRedis(Path("data") / "redis")
    try:
        assert redis.Redis.from_url(server.start()).ping()
    finally:
        server.stop()
    assert (tmp_path / "data" / "redis" / "redis.log").is_file()
