"""The money counters (prometheus-client): what a completed operation was billed is counted by
class, base model and tenant; a quota refusal by the limit it met (counted in the API process,
so in this one: the app runs in process)."""

from __future__ import annotations

import secrets

import pytest
from prometheus_client import REGISTRY

from tests.secure_app import SecureApp
from treadle.platform.billing import metering, quotas
from treadle.platform.tenancy import keys, tenants

pytestmark = pytest.mark.integration


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_charge_is_counted_by_class_model_and_tenant() -> None:
    tenant = f"count-{secrets.token_hex(3)}"
    charge = metering.Charge(tenant, "m", {"prefill": 3, "sample": 0, "train": 7},
                             {"prefill": 2, "sample": 0, "train": 5})  # fmt: skip
    metering.count_charge(charge)
    assert _value("treadle_tokens_total", token_class="train", base_model="m", tenant=tenant) == 7
    assert _value("treadle_cost_usd_total", token_class="prefill", base_model="m",
                  tenant=tenant) == pytest.approx(2e-6)  # fmt: skip
    assert _value("treadle_tokens_total", token_class="sample", base_model="m", tenant=tenant) == 0


def test_a_refusal_by_quota_is_counted_by_its_limit(secure: SecureApp) -> None:
    secure.keep_worker_alive()
    tenant = f"count-{secrets.token_hex(3)}"
    with secure.engine.begin() as conn:
        _, key = keys.create_tenant_key(conn, tenant, "admin")
        operator = tenants.Principal("key-operator", tenants.DEFAULT_TENANT, "operator")
        quotas.set_quota(conn, operator, tenant, quotas.Quota(max_sessions=0))
    before = _value("treadle_quota_rejections_total", reason="max_sessions")
    session = secure.call("POST", "/api/v1/create_session", key, json={}).get_json()
    answer = secure.call("POST", "/api/v1/create_model", key, json={
        "session_id": session["session_id"], "model_seq_id": 0,
        "base_model": "treadle/tiny-debug",
    })  # fmt: skip
    assert answer.status_code == 429, answer.get_data(as_text=True)
    assert answer.get_json()["error"]["limit"] == "max_sessions"
    assert _value("treadle_quota_rejections_total", reason="max_sessions") == before + 1
