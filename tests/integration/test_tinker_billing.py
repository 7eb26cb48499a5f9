"""Billing against the served platform (`treadle up`: API, real workers) after real operations
of a tenant of this module's own: the official `tinker billing usage` command (run as a
subprocess, pointed at Treadle by TINKER_BASE_URL / TINKER_API_KEY) shows the same token totals
as `GET /api/v1/treadle/usage` for the same window, and the SDK's `get_usage` agrees with both."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from tinker import types

import treadle
from tests.conftest import Platform
from tests.integration.wire_client import datum
from treadle.client.admin import AdminClient
from treadle.client.billing import SessionUsage

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"


@dataclass(frozen=True)
class Served:
    """A tenant's real operations on the served platform, and a window holding them."""

    platform: Platform
    key: str
    model_id: str
    usage: SessionUsage  # TrainingClient.get_usage() after its operations
    starting_on: str
    ending_before: str

    def treadle_usage(self, **params: str) -> Any:
        response = httpx.get(
            f"{self.platform.base_url}/api/v1/treadle/usage",
            params={"since": self.starting_on, "until": self.ending_before, **params},
            headers={"X-API-Key": self.key},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        return response.json()


def _hour(value: datetime) -> datetime:
    return value.replace(minute=0, second=0, microsecond=0)


def _z(value: datetime) -> str:
    return f"{value:%Y-%m-%dT%H:%M:%SZ}"


@pytest.fixture(scope="module")
def served(platform: Platform) -> Iterator[Served]:
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"tinker-billing-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    start = _hour(datetime.now(UTC))
    svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
    with svc.create_lora_training_client(
        BASE_MODEL, training_session_name="billing-run", rank=4, max_cost_usd=2.0
    ) as tc:
        tc.forward_backward([datum([1, 2, 3, 4, 5]), datum([6, 7, 8])], "cross_entropy").result()
        tc.optim_step().result()
        tc.forward([datum([9, 10, 11])], "cross_entropy").result()
        sampler = tc.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=4, temperature=0.0)
        sampler.sample([1, 2, 3], num_samples=2, sampling_params=params).result()
        usage = tc.get_usage()
        model_id = tc.model_id
    svc.close()
    end = _hour(datetime.now(UTC)) + timedelta(hours=1)
    yield Served(platform, key, model_id, usage, _z(start), _z(end))


def test_tinker_billing_usage_shows_the_token_totals_of_treadle_usage(served: Served) -> None:
    env = {**os.environ, "TINKER_BASE_URL": served.platform.base_url, "TINKER_API_KEY": served.key}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinker.cli",
            "-f",
            "json",
            "billing",
            "usage",
            served.starting_on,
            served.ending_before,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout)["data"]
    tinker_totals = {"training": 0, "sampling_prefill": 0, "sampling_sample": 0}
    for row in rows:
        if row["event_info"]["type"] in tinker_totals:
            tinker_totals[row["event_info"]["type"]] += row["event_info"]["token_count"]
    total = served.treadle_usage()["total"]
    assert tinker_totals == {
        "training": total["train_tokens"],
        "sampling_prefill": total["prefill_tokens"],
        "sampling_sample": total["sample_tokens"],
    }
    assert total["train_tokens"] == 4 + 2  # the forward_backward's two datums
    assert total["sample_tokens"] > 0 and total["prefill_tokens"] >= 2 + 3  # forward, prompt


def test_a_training_clients_usage_is_its_sessions_usage(served: Served) -> None:
    groups = served.treadle_usage(by="session")["groups"]
    mine = next(g for g in groups if g["session_id"] == served.model_id)
    assert served.usage.model_id == served.model_id
    assert served.usage.usage.tokens["train"] == mine["train_tokens"] == 6
    assert served.usage.usage.cost_usd == Decimal(mine["cost_usd"])


def test_max_cost_usd_at_creation_is_the_sessions_cap(served: Served) -> None:
    assert served.usage.max_cost_usd == Decimal("2")


def test_the_service_clients_usage_matches_the_route(served: Served) -> None:
    svc = treadle.ServiceClient(base_url=served.platform.base_url, api_key=served.key)
    report = svc.get_usage(since=served.starting_on, until=served.ending_before, by=["op_type"])
    route = served.treadle_usage(by="op_type")
    assert report.total.tokens == {
        "prefill": route["total"]["prefill_tokens"],
        "sample": route["total"]["sample_tokens"],
        "train": route["total"]["train_tokens"],
    }
    assert {g.key["op_type"] for g in report.groups} == {g["op_type"] for g in route["groups"]}
    svc.close()
