"""The tinker SDK's telemetry: batches of client events it posts to /api/v1/telemetry when a
client closes (and every 10 s), unless TINKER_TELEMETRY=0. Treadle answers them as Tinker does
and drops them, so a user who leaves telemetry on sees no warning. Treadle's own SDK turns it off
unless the user set the variable (docs/tinker-compatibility.md, "Known SDK faults").

The suite runs the SDK with telemetry off (tests/conftest.py); these tests turn it back on or
clear it. Each runs against an API replica of the platform that counts its answers.
"""

from __future__ import annotations

import logging

import pytest
import tinker

import treadle
from tests.conftest import Platform, new_tenant_key
from tests.served_app import Counts, replica

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
TELEMETRY = "/api/v1/telemetry"
# A bound on close(), so that a hang fails the test instead of stalling the suite.
CLOSE_SECONDS = 60


def test_the_sdks_telemetry_is_answered_and_logs_no_warning(
    platform: Platform, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    key = new_tenant_key(platform, "telemetry-on")
    with replica(platform) as (base_url, counts):
        caplog.set_level(logging.WARNING)
        service = tinker.ServiceClient(base_url=base_url, api_key=key)
        service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        assert service.get_telemetry() is not None
        service.close("success").result(timeout=CLOSE_SECONDS)  # flushes the session's events
    posts = {status: n for (path, status), n in counts.items() if path == TELEMETRY}
    assert posts.keys() == {200} and posts[200] >= 1, dict(counts)
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.name.startswith("tinker")]
    assert loud == []


def _answers_to_treadles_sdk(platform: Platform, key: str) -> Counts:
    """The replica's answers while Treadle's SDK opens a session and closes its client."""
    with (
        replica(platform) as (base_url, counts),
        treadle.ServiceClient(base_url=base_url, api_key=key) as service,
    ):
        service.create_lora_training_client(BASE_MODEL, rank=4)
    return counts


def test_treadles_sdk_sends_no_telemetry_unless_asked(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TINKER_TELEMETRY")
    key = new_tenant_key(platform, "telemetry-off")
    counts = _answers_to_treadles_sdk(platform, key)
    assert counts[("/api/v1/create_session", 200)] == 1, dict(counts)
    assert not [path for path, _ in counts if path == TELEMETRY]

    # A user who sets the variable keeps it.
    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    counts = _answers_to_treadles_sdk(platform, key)
    assert counts[(TELEMETRY, 200)] >= 1, dict(counts)
