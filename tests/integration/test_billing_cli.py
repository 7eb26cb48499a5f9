"""`treadle prices|quotas|usage|bill`, run as the user runs them (a subprocess with
TREADLE_BASE_URL / TREADLE_API_KEY) against the served platform. Ledger rows are written with
`metering.charge` (as a settlement writes them) for a real session of a tenant of this module's
own, under a base model name of its own, so the prices set here touch no other test."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import secrets
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from tests.conftest import Platform
from tests.integration.wire_client import WireClient
from treadle.client.admin import AdminClient
from treadle.platform.billing import metering
from treadle.platform.sessions.sessions import get_session

pytestmark = pytest.mark.integration


@dataclasses.dataclass(frozen=True)
class World:
    platform: Platform
    tenant: str
    key: str  # the tenant's admin key
    model: str  # base model name of this module's own, priced through the CLI
    sessions: tuple[str, str]
    month: str


def treadle(world: World, *args: str, key: str | None = None, ok: bool = True) -> Any:
    env = {
        **os.environ,
        "TREADLE_BASE_URL": world.platform.base_url,
        "TREADLE_API_KEY": key or world.platform.admin_key,
    }
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done


def charge(engine: sa.Engine, model_id: str, base_model: str, **tokens: int) -> None:
    with engine.begin() as conn:
        session = dataclasses.replace(get_session(conn, None, model_id), base_model=base_model)
        metering.charge(
            conn,
            request_id=f"req-{secrets.token_hex(8)}",
            session=session,
            sampler_id=None,
            actor=None,
            op_type="forward_backward",
            tokens=tokens,
        )


@pytest.fixture(scope="module")
def world(platform: Platform, engine: sa.Engine) -> World:
    admin = AdminClient(platform.base_url, platform.admin_key)
    tenant = f"cli-billing-{secrets.token_hex(3)}"
    key = admin.create_tenant(tenant)["api_key"]
    admin.close()
    client = WireClient(platform.base_url, key)
    sessions = (client.create_model(), client.create_model())
    for model_id in sessions:
        client.post(f"treadle/sessions/{model_id}/stop", {})
    with engine.connect() as conn:
        now = conn.execute(sa.select(sa.func.now())).scalar_one()
    left = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1) - now
    if left < timedelta(seconds=20):  # the charges below must fall in `now`'s month
        time.sleep(left.total_seconds() + 0.1)
        now += left
    model = f"test/cli-{secrets.token_hex(4)}"
    w = World(platform, tenant, key, model, sessions, f"{now.astimezone(UTC):%Y-%m}")
    treadle(w, "prices", "set", model, "--prefill", "0.10", "--sample", "0.40", "--train", "0.30")
    charge(engine, sessions[0], model, train=1000, prefill=10)
    charge(engine, sessions[0], model, train=1000)
    charge(engine, sessions[1], model, sample=500)
    return w


def test_prices_set_from_a_date_is_scheduled_and_listed(world: World) -> None:
    treadle(world, "prices", "set", world.model, "--train", "0.35", "--from", "2099-12-01")
    out = treadle(world, "prices", "list", "--model", world.model, "--format", "csv").stdout
    rows = [
        (r["token_class"], r["usd_per_million"], r["status"], r["effective_from"])
        for r in csv.DictReader(io.StringIO(out))
    ]
    assert ("train", "0.35", "scheduled", "2099-12-01T00:00:00Z") in rows
    assert [r[:3] for r in rows if r[2] == "in_effect"] == [
        ("prefill", "0.10", "in_effect"),
        ("sample", "0.40", "in_effect"),
        ("train", "0.30", "in_effect"),
    ]


def test_prices_set_with_a_tenant_key_fails_and_says_why(world: World) -> None:
    done = treadle(world, "prices", "set", world.model, "--train", "9", key=world.key, ok=False)
    assert "403" in done.stderr and "operator" in done.stderr


def test_quotas_set_then_get(world: World) -> None:
    treadle(
        world,
        "quotas",
        "set",
        "--tenant",
        world.tenant,
        "--monthly-usd",
        "50",
        "--max-sessions",
        "3",
        "--requests-per-second",
        "20",
    )
    got = json.loads(
        treadle(world, "quotas", "get", "--tenant", world.tenant, "--format", "json").stdout
    )
    assert (got["monthly_usd"], got["max_sessions"], got["requests_per_second"]) == ("50.00", 3, 20)
    treadle(world, "quotas", "set", "--tenant", world.tenant, "--requests-per-second", "none")


def test_usage_by_session_as_csv(world: World) -> None:
    out = treadle(
        world,
        "usage",
        "--tenant",
        world.tenant,
        "--month",
        world.month,
        "--by",
        "session",
        "--format",
        "csv",
    ).stdout
    rows = {r["session_id"]: r for r in csv.DictReader(io.StringIO(out))}
    first, second = world.sessions
    assert (rows[first]["train_tokens"], rows[first]["prefill_tokens"]) == ("2000", "10")
    assert (rows[first]["cost_usd"], rows[second]["cost_usd"]) == ("0.000601", "0.000200")


def test_usage_as_json_is_the_routes_answer(world: World) -> None:
    got = json.loads(
        treadle(world, "usage", "--month", world.month, "--format", "json", key=world.key).stdout
    )
    assert (got["tenant_id"], got["total"]["cost_usd"]) == (world.tenant, "0.000801")


def test_usage_table_ends_with_the_total(world: World) -> None:
    out = treadle(world, "usage", "--month", world.month, "--by", "session", key=world.key).stdout
    last = out.strip().splitlines()[-1].split()
    assert last[0] == "total" and "0.000801" in last


def test_bill_lists_lines_then_the_total(world: World) -> None:
    out = treadle(
        world, "bill", "--tenant", world.tenant, "--month", world.month, "--format", "csv"
    ).stdout
    rows = [
        (r["base_model"], r["token_class"], r["tokens"], r["usd_per_million"], r["amount_usd"])
        for r in csv.DictReader(io.StringIO(out))
    ]
    assert rows == [
        (world.model, "prefill", "10", "0.10", "0.000001"),
        (world.model, "sample", "500", "0.40", "0.000200"),
        (world.model, "train", "2000", "0.30", "0.000600"),
        ("total", "", "", "", "0.000801"),
    ]


def test_bill_as_a_table_is_titled_with_tenant_and_month(world: World) -> None:
    out = treadle(world, "bill", "--month", world.month, key=world.key).stdout
    assert out.splitlines()[0] == f"bill of {world.tenant} for {world.month} (UTC)"
    assert out.strip().splitlines()[-1].split() == ["total", "0.000801"]


def test_a_bad_month_fails_with_the_servers_reason(world: World) -> None:
    done = treadle(world, "bill", "--month", "November", key=world.key, ok=False)
    assert "400" in done.stderr and "YYYY-MM" in done.stderr


def test_usage_now_needs_no_window(world: World) -> None:
    got = json.loads(treadle(world, "usage", "--format", "json", key=world.key).stdout)
    assert datetime.fromisoformat(got["since"]).day == 1
