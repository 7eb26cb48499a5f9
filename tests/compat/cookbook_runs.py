"""What the cookbook compat tests share: a recipe run as a user runs it (`run_recipe`), its
JSON-lines logs (`jsonl`) and the requests its tenant had admitted (`requested`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from tests.compat import users
from tests.conftest import Platform
from treadle.platform import db
from treadle.platform.eventlog.schema import events

TIMEOUT = 600


def run_recipe(
    platform: Platform, key: str, tmp: Path, module: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """`python -m treadle.cookbook <module> <args>` as a user runs it: the tinker variables set,
    the hub switched off, HF_HOME at `tmp / "hf-home"` (a test may build a datasets cache
    there first), caches in `tmp`; it must exit 0."""
    env = users.user_env(
        platform.base_url, key, tmp / "hf-home",
        TINKER_COOKBOOK_RUNS_DIR=str(tmp / "runs"),
        TREADLE_CACHE_DIR=str(tmp / "cache"),
        HF_HUB_OFFLINE="1",  # no hub: tokenizers come from Treadle
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cookbook", module, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "Retrying request" not in output  # quiet long-polls
    assert "is not recommended for model" not in output
    return done


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def requested(platform: Platform, tenant_id: str, op_type: str) -> list[dict[str, Any]]:
    """The payload of every `op_type` operation the tenant had admitted, in log order."""
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(events.c.data)
                .where(
                    events.c.tenant_id == tenant_id,
                    events.c.type == "OperationRequested",
                    events.c.data["type"].astext == op_type,
                )
                .order_by(events.c.position)
            ).scalars()
            return [dict(d["payload"]) for d in rows]
    finally:
        engine.dispose()


def losses_trained(platform: Platform, tenant_id: str) -> set[str]:
    """The loss_fn of every forward_backward the tenant had admitted."""
    return {str(p["loss_fn"]) for p in requested(platform, tenant_id, "forward_backward")}
