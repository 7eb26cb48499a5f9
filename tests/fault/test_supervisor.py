"""`treadle up` supervises what it started: a worker, the embedded Redis or the embedded
PostgreSQL killed with SIGKILL comes back on its own (same worker id, same URL), and up.json says
so. Each test kills one process of the shared platform and waits for it with a deadline."""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa

import treadle
from tests.fault.conftest import Up, start_up, wait_for
from treadle.platform.config import PlatformConfig

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    """A lease TTL far longer than any wait here: a dead worker's session can only move
    because the supervisor released it, never because its lease ran out."""
    with start_up(env={"TREADLE_LEASE_TTL_SECONDS": "120"}) as platform:
        yield platform


def _api_answers(up: Up) -> bool:
    return httpx.get(f"{up.base_url}/healthz", timeout=2).status_code == 200


def _heartbeat_pid(up: Up, worker_id: str) -> int | None:
    """The pid the worker's latest heartbeat carries (None while it has no row)."""
    with up.db.connect() as conn:
        info = conn.execute(
            sa.text(
                "SELECT info FROM workers "
                "WHERE id = :id AND heartbeat_at > now() - interval '3 seconds'"
            ),
            {"id": worker_id},
        ).scalar_one_or_none()
    return None if info is None else int(info["pid"])


def _held(up: Up, model_id: str) -> tuple[str, int] | None:
    worker_id, epoch = up.holder(model_id)
    return (worker_id, epoch) if worker_id else None


def _released(up: Up, model_id: str, reason: str) -> list[dict[str, Any]] | None:
    """The session's SessionReleased events with this reason; None while there is none."""
    return [e for e in up.events(model_id, "SessionReleased") if e["reason"] == reason] or None


def _changed(up: Up, key: str, pid: int) -> dict[str, Any] | None:
    """up.json's entry for `key` ("redis", "postgres") once its pid is no longer `pid`."""
    entry: dict[str, Any] = up.state()[key]
    return entry if entry["pid"] != pid else None


def test_up_names_its_workers_as_treadle_worker_would(up: Up) -> None:
    from treadle.platform.sessions.supervisor import default_worker_id

    config = PlatformConfig(database_url=up.database_url)
    workers = up.state()["workers"]
    assert {w["index"]: wid for wid, w in workers.items()} == {
        i: default_worker_id(config, i) for i in range(2)
    }


def test_killed_worker_is_retired_at_once_and_restarted_under_its_id(up: Up) -> None:
    up.wait_ready(2)
    with treadle.ServiceClient(base_url=up.base_url, api_key=up.admin_key) as client:
        training = client.create_lora_training_client(
            "treadle/tiny-debug", training_session_name="supervisor-worker-kill", rank=4, seed=1
        )
        model_id = str(training.model_id)
        worker_id, epoch = wait_for(lambda: _held(up, model_id), 30, "a worker to hold the session")
        before = up.state()["workers"][worker_id]

        os.kill(before["pid"], signal.SIGKILL)

        # Released by the supervisor (its reason, the epoch it held): with a 120 s lease TTL
        # nothing else could have moved it within this wait.
        released = wait_for(
            lambda: _released(up, model_id, "the worker process exited (code -9)"),
            30,
            "the supervisor to release the dead worker's lease",
        )
        assert [(e["worker_id"], e["epoch"]) for e in released] == [(worker_id, epoch)]
        after = wait_for(
            lambda: (w := up.state()["workers"][worker_id])["pid"] != before["pid"] and w,
            10,
            "the worker to be restarted",
        )
        assert after["index"] == before["index"]
        assert after["restarts"] == before["restarts"] + 1
        wait_for(lambda: _heartbeat_pid(up, worker_id) == after["pid"], 90, "its heartbeat")
        training.stop()


def test_killed_redis_is_restarted_on_the_same_port(up: Up) -> None:
    up.wait_ready(2)
    before = up.state()
    url = before["redis_url"]

    os.kill(before["redis"]["pid"], signal.SIGKILL)

    after = wait_for(lambda: _changed(up, "redis", before["redis"]["pid"]), 10, "a new Redis")
    assert after["restarts"] == before["redis"]["restarts"] + 1
    assert up.state()["redis_url"] == url
    client = redis.Redis.from_url(url, socket_timeout=2)
    assert wait_for(client.ping, 10, "Redis to answer on the same URL")
    client.close()
    wait_for(lambda: _api_answers(up), 30, "the API's health check")


def test_killed_postgres_is_restarted_with_its_data(up: Up) -> None:
    up.wait_ready(2)
    tenant = "fault-" + secrets.token_hex(4)
    created = httpx.post(
        f"{up.base_url}/api/v1/treadle/tenants",
        json={"id": tenant},
        headers={"X-API-Key": up.admin_key},
        timeout=10,
    )
    assert created.status_code == 201, created.text
    before = up.state()

    os.kill(before["postgres"]["pid"], signal.SIGKILL)

    after = wait_for(
        lambda: _changed(up, "postgres", before["postgres"]["pid"]), 60, "a new PostgreSQL"
    )
    assert after["restarts"] == before["postgres"]["restarts"] + 1
    assert up.state()["database_url"] == before["database_url"]

    def tenant_rows() -> int:
        with up.db.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT count(*) FROM tenants WHERE id = :id"), {"id": tenant}
                ).scalar_one()
            )

    assert wait_for(tenant_rows, 30, "PostgreSQL to answer with the tenant") == 1
    wait_for(lambda: _api_answers(up), 30, "the API's health check")
