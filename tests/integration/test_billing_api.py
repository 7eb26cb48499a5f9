"""The billing routes in process (`create_app(config).test_client()` on a real PostgreSQL, the
`secure` app of tests/security/conftest.py): prices, quotas, usage, bills, a session's usage,
and the Tinker billing routes. Its worker is only a heartbeat, so ledger rows are written the way
a settlement writes them, with `metering.charge` inside a transaction; each test has tenants and
a base model name of its own, so no test sees another's usage or prices."""

from __future__ import annotations

import dataclasses
import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.integration.wire_client import datum
from tests.secure_app import SecureApp
from treadle.platform.billing import metering
from treadle.platform.checkpoints import auto_checkpoints, checkpoints
from treadle.platform.sessions.sessions import get_session
from treadle.platform.tenancy import keys

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"  # what the sessions run; the ledger rows say `priced` below


@dataclasses.dataclass
class Tenant:
    id: str
    key: str  # an admin key of the tenant
    key_id: str


@pytest.fixture
def app(secure: SecureApp) -> SecureApp:
    """The app, with at least 20 s left of this UTC hour (so of this day and month): what a test
    charges falls in the hour, day and month it then asks about."""
    secure.keep_worker_alive()
    now = db_now(secure)
    left = _next_hour(now) - now
    if left < timedelta(seconds=20):
        time.sleep(left.total_seconds() + 0.1)
    return secure


def _next_hour(value: datetime) -> datetime:
    return value.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)


@pytest.fixture
def priced() -> str:
    """A base model name of this test's own, for prices no other test sets."""
    return f"test/priced-{secrets.token_hex(4)}"


def new_tenant(app: SecureApp, role: str = "admin") -> Tenant:
    tenant_id = f"bill-{secrets.token_hex(4)}"
    with app.engine.begin() as conn:
        key_id, key = keys.create_tenant_key(conn, tenant_id, role)
    return Tenant(tenant_id, key, key_id)


def member_of(app: SecureApp, tenant: Tenant) -> str:
    with app.engine.begin() as conn:
        return keys.create_tenant_key(conn, tenant.id, "member")[1]


def ok(response: Any, status: int = 200) -> Any:
    assert response.status_code == status, response.get_data(as_text=True)
    return response.get_json()


def new_model(app: SecureApp, key: str, **extra: Any) -> str:
    session = ok(app.call("POST", "/api/v1/create_session", key, json={"tags": []}))
    body = {
        "session_id": session["session_id"],
        "model_seq_id": 0,
        "base_model": BASE_MODEL,
        "lora_config": {"rank": 4},
        **extra,
    }
    return str(ok(app.call("POST", "/api/v1/create_model", key, json=body))["model_id"])


def charge(app: SecureApp, model_id: str, base_model: str, key_id: str, **tokens: int) -> None:
    """A completed operation's ledger row, as the settlement writes it."""
    with app.engine.begin() as conn:
        session = dataclasses.replace(get_session(conn, None, model_id), base_model=base_model)
        metering.charge(
            conn,
            request_id=f"req-{secrets.token_hex(8)}",
            session=session,
            sampler_id=None,
            actor=key_id,
            op_type="forward_backward",
            tokens=tokens,
        )


def set_prices(app: SecureApp, base_model: str, status: int = 201, **body: Any) -> Any:
    return ok(
        app.call(
            "POST",
            "/api/v1/treadle/prices",
            app.operator_key,
            json={"base_model": base_model, **body},
        ),
        status,
    )


def db_now(app: SecureApp) -> datetime:
    with app.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.now())).scalar_one()  # type: ignore[no-any-return]


def this_month(app: SecureApp) -> str:
    return f"{db_now(app).astimezone(UTC):%Y-%m}"


# --- prices -------------------------------------------------------------------------------------


def test_prices_set_by_the_operator_are_listed_with_their_status(app: SecureApp, priced: str):
    later = (db_now(app) + timedelta(days=30)).isoformat()
    set_prices(app, priced, train="0.30", prefill=0.1)
    set_prices(app, priced, train="0.5", effective_from=later)
    listed = ok(app.call("GET", f"/api/v1/treadle/prices?base_model={priced}", app.operator_key))
    got = [(p["token_class"], p["usd_per_million"], p["status"]) for p in listed["prices"]]
    assert got == [
        ("prefill", "0.10", "in_effect"),
        ("train", "0.30", "in_effect"),
        ("train", "0.50", "scheduled"),
    ]


def test_any_key_reads_prices(app: SecureApp, priced: str) -> None:
    set_prices(app, priced, sample="0.4")
    member = member_of(app, new_tenant(app))
    listed = ok(app.call("GET", f"/api/v1/treadle/prices?base_model={priced}", member))
    assert [p["usd_per_million"] for p in listed["prices"]] == ["0.40"]


def test_a_tenant_admin_cannot_set_prices(app: SecureApp, priced: str) -> None:
    admin = new_tenant(app).key
    response = app.call(
        "POST", "/api/v1/treadle/prices", admin, json={"base_model": priced, "train": "1"}
    )
    assert response.status_code == 403, response.get_data(as_text=True)
    assert "operator" in response.get_json()["error"]["message"]


def test_a_price_taking_effect_in_the_past_is_refused(app: SecureApp, priced: str) -> None:
    body = set_prices(app, priced, 400, train="1", effective_from="2020-01-01")
    assert "in the past" in body["error"]["message"]


def test_a_price_change_needs_a_token_class(app: SecureApp, priced: str) -> None:
    body = set_prices(app, priced, 400)
    assert "prefill, sample, train" in body["error"]["message"]


# --- bills --------------------------------------------------------------------------------------


def test_a_price_change_mid_month_bills_earlier_usage_at_the_old_price(
    app: SecureApp, priced: str
) -> None:
    tenant = new_tenant(app)
    model = new_model(app, tenant.key)
    set_prices(app, priced, train="0.10")
    charge(app, model, priced, tenant.key_id, train=1000)
    change_at = db_now(app) + timedelta(seconds=1.5)
    set_prices(app, priced, train="0.30", effective_from=change_at.isoformat())
    charge(app, model, priced, tenant.key_id, train=3000)  # before the change: old price
    while db_now(app) < change_at:
        time.sleep(0.1)
    charge(app, model, priced, tenant.key_id, train=2000)
    bill = ok(app.call("GET", f"/api/v1/treadle/bill?month={this_month(app)}", tenant.key))
    lines = [
        (x["token_class"], x["usd_per_million"], x["tokens"], x["amount_usd"])
        for x in bill["lines"]
    ]
    assert lines == [("train", "0.10", 4000, "0.000400"), ("train", "0.30", 2000, "0.000600")]
    assert (bill["total_usd"], bill["total_micro_usd"], bill["unpriced"]) == (
        "0.001000",
        1000,
        False,
    )


def test_a_bill_has_one_line_per_model_and_class_rounded_per_operation(
    app: SecureApp, priced: str
) -> None:
    tenant = new_tenant(app)
    model = new_model(app, tenant.key)
    set_prices(app, priced, prefill="1.5", sample="2.25")
    for _ in range(3):  # 333 x 1.5 = 499.5 -> 500 micro-USD each time, rounded half up
        charge(app, model, priced, tenant.key_id, prefill=333, sample=2)
    bill = ok(app.call("GET", "/api/v1/treadle/bill", tenant.key))
    assert [(x["token_class"], x["tokens"], x["amount_micro_usd"]) for x in bill["lines"]] == [
        ("prefill", 999, 1500),
        ("sample", 6, 15),  # 2 x 2.25 = 4.5 -> 5, three times
    ]
    assert bill["total_usd"] == "0.001515"


def test_a_model_without_a_price_bills_at_zero_and_says_so(app: SecureApp, priced: str) -> None:
    tenant = new_tenant(app)
    charge(app, new_model(app, tenant.key), priced, tenant.key_id, train=500)
    bill = ok(app.call("GET", "/api/v1/treadle/bill", tenant.key))
    assert bill["lines"][0]["usd_per_million"] is None
    assert (bill["lines"][0]["unpriced"], bill["lines"][0]["amount_usd"]) == (True, "0.000000")
    assert bill["unpriced"] is True


def test_a_month_is_written_yyyy_mm(app: SecureApp) -> None:
    body = ok(app.call("GET", "/api/v1/treadle/bill?month=2026-13", new_tenant(app).key), 400)
    assert "YYYY-MM" in body["error"]["message"]


# --- usage --------------------------------------------------------------------------------------


def test_usage_groups_by_session_and_sums_to_the_total(app: SecureApp, priced: str) -> None:
    tenant = new_tenant(app)
    set_prices(app, priced, train="1")
    first, second = new_model(app, tenant.key), new_model(app, tenant.key)
    charge(app, first, priced, tenant.key_id, train=100)
    charge(app, first, priced, tenant.key_id, train=100, prefill=7)
    charge(app, second, priced, tenant.key_id, train=50)
    report = ok(app.call("GET", "/api/v1/treadle/usage?by=session,day", tenant.key))
    day = f"{db_now(app).astimezone(UTC):%Y-%m-%d}"
    got = {
        (g["session_id"], g["day"]): (g["operations"], g["train_tokens"], g["cost_usd"])
        for g in report["groups"]
    }
    assert got == {(first, day): (2, 200, "0.000200"), (second, day): (1, 50, "0.000050")}
    total = report["total"]
    assert (total["train_tokens"], total["prefill_tokens"], total["cost_micro_usd"]) == (
        250,
        7,
        250,
    )
    assert total["unpriced"] is True  # no prefill price was set for this model


def test_usage_counts_only_the_window(app: SecureApp, priced: str) -> None:
    tenant = new_tenant(app)
    charge(app, new_model(app, tenant.key), priced, tenant.key_id, sample=9)
    after = (db_now(app) + timedelta(seconds=1)).isoformat()
    later = (db_now(app) + timedelta(hours=1)).isoformat()
    query = f"/api/v1/treadle/usage?since={after}&until={later}".replace("+", "%2B")
    assert ok(app.call("GET", query, tenant.key))["total"]["sample_tokens"] == 0
    assert ok(app.call("GET", "/api/v1/treadle/usage", tenant.key))["total"]["sample_tokens"] == 9


def test_usage_groups_by_key(app: SecureApp, priced: str) -> None:
    tenant = new_tenant(app)
    model = new_model(app, tenant.key)
    charge(app, model, priced, tenant.key_id, train=3)
    charge(app, model, priced, "another-key", train=4)
    report = ok(app.call("GET", "/api/v1/treadle/usage?by=key", tenant.key))
    assert {g["key_id"]: g["train_tokens"] for g in report["groups"]} == {
        tenant.key_id: 3,
        "another-key": 4,
    }


def test_an_unknown_grouping_is_refused_with_the_choices(app: SecureApp) -> None:
    body = ok(app.call("GET", "/api/v1/treadle/usage?by=colour", new_tenant(app).key), 400)
    assert "tenant, session, key, base_model, day, op_type" in body["error"]["message"]


def test_until_before_since_is_refused(app: SecureApp) -> None:
    query = "/api/v1/treadle/usage?since=2026-02-01&until=2026-01-01"
    body = ok(app.call("GET", query, new_tenant(app).key), 400)
    assert "must be after since" in body["error"]["message"]


def test_a_member_sees_their_own_tenant_only(app: SecureApp, priced: str) -> None:
    a, b = new_tenant(app), new_tenant(app)
    charge(app, new_model(app, a.key), priced, a.key_id, train=11)
    member = member_of(app, b)
    own = ok(app.call("GET", "/api/v1/treadle/usage?by=tenant", member))
    assert (own["tenant_id"], own["groups"]) == (b.id, [])
    refused = app.call("GET", f"/api/v1/treadle/usage?tenant={a.id}", member)
    assert refused.status_code == 403
    assert ok(app.call("GET", "/api/v1/treadle/bill", member))["lines"] == []


def test_the_operator_reads_any_tenant_and_every_tenant(app: SecureApp, priced: str) -> None:
    a, b = new_tenant(app), new_tenant(app)
    charge(app, new_model(app, a.key), priced, a.key_id, train=11)
    charge(app, new_model(app, b.key), priced, b.key_id, train=22)
    one = ok(app.call("GET", f"/api/v1/treadle/usage?tenant={a.id}", app.operator_key))
    assert one["total"]["train_tokens"] == 11
    every = ok(app.call("GET", "/api/v1/treadle/usage?tenant=*&by=tenant", app.operator_key))
    by_tenant = {g["tenant_id"]: g["train_tokens"] for g in every["groups"]}
    assert (by_tenant[a.id], by_tenant[b.id]) == (11, 22)


def test_the_operator_asking_for_an_unknown_tenant_gets_404(app: SecureApp) -> None:
    response = app.call("GET", "/api/v1/treadle/bill?tenant=no-such-tenant", app.operator_key)
    assert response.status_code == 404


# --- a session's usage --------------------------------------------------------------------------


def test_a_session_shows_its_usage_spend_and_cap(app: SecureApp, priced: str) -> None:
    tenant = new_tenant(app)
    model = new_model(app, tenant.key, max_cost_usd=2.0)
    set_prices(app, priced, train="0.3")
    charge(app, model, priced, tenant.key_id, train=10_000)
    got = ok(app.call("GET", f"/api/v1/treadle/sessions/{model}/usage", tenant.key))
    assert (got["model_id"], got["train_tokens"], got["cost_usd"]) == (model, 10_000, "0.003000")
    assert (got["max_cost_usd"], got["spent_usd"]) == ("2.000000", "0.003000")
    assert got["cost_usd_by_class"] == {
        "prefill": "0.000000",
        "sample": "0.000000",
        "train": "0.003000",
    }


def test_another_tenants_session_usage_is_not_found(app: SecureApp) -> None:
    model = new_model(app, new_tenant(app).key)
    response = app.call("GET", f"/api/v1/treadle/sessions/{model}/usage", new_tenant(app).key)
    assert response.status_code == 404


# --- quotas -------------------------------------------------------------------------------------


def test_the_operator_changes_a_quota_and_keeps_what_is_not_sent(app: SecureApp) -> None:
    tenant = new_tenant(app)
    path = f"/api/v1/treadle/quotas/{tenant.id}"
    ok(app.call("PATCH", path, app.operator_key, json={"monthly_usd": "50", "max_sessions": 3}))
    got = ok(app.call("PATCH", path, app.operator_key, json={"requests_per_second": 20}))
    assert (got["monthly_usd"], got["max_sessions"], got["requests_per_second"]) == ("50.00", 3, 20)


def test_null_removes_a_limit(app: SecureApp) -> None:
    tenant = new_tenant(app)
    path = f"/api/v1/treadle/quotas/{tenant.id}"
    ok(app.call("PATCH", path, app.operator_key, json={"max_sessions": 3}))
    assert (
        ok(app.call("PATCH", path, app.operator_key, json={"max_sessions": None}))["max_sessions"]
        is None
    )


def test_a_quota_applies_from_the_next_request(app: SecureApp) -> None:
    tenant = new_tenant(app)
    model = new_model(app, tenant.key)
    path = f"/api/v1/treadle/quotas/{tenant.id}"
    ok(app.call("PATCH", path, app.operator_key, json={"max_request_tokens": 2}))
    response = app.call(
        "POST", "/api/v1/optim_step", tenant.key, json={"model_id": model, "seq_id": 1}
    )
    assert response.status_code == 200  # no tokens: not limited

    request = types.ForwardBackwardRequest(
        model_id=model,
        seq_id=2,
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum([1, 2, 3, 4])], loss_fn="cross_entropy"
        ),
    )
    refused = app.call(
        "POST",
        "/api/v1/forward_backward",
        tenant.key,
        data=forward_backward_request_to_proto(request).SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert refused.status_code == 413, refused.get_data(as_text=True)
    assert (refused.get_json()["error"]["limit"], refused.get_json()["error"]["value"]) == (
        "max_request_tokens",
        2,
    )


def test_a_member_reads_its_quota_but_cannot_change_it(app: SecureApp) -> None:
    tenant = new_tenant(app)
    member = member_of(app, tenant)
    got = ok(app.call("GET", f"/api/v1/treadle/quotas/{tenant.id}", member))
    assert (got["tenant_id"], got["monthly_usd"], got["this_month"]["settled_usd"]) == (
        tenant.id,
        None,
        "0.000000",
    )
    refused = app.call(
        "PATCH", f"/api/v1/treadle/quotas/{tenant.id}", tenant.key, json={"max_sessions": 100}
    )
    assert refused.status_code == 403


def test_a_quota_for_an_unknown_tenant_is_not_found(app: SecureApp) -> None:
    response = app.call(
        "PATCH", "/api/v1/treadle/quotas/no-such-tenant", app.operator_key, json={"max_sessions": 1}
    )
    assert response.status_code == 404


# --- the Tinker billing routes ------------------------------------------------------------------


def hour_window(app: SecureApp, hours_back: int = 0) -> tuple[datetime, datetime, str]:
    end = db_now(app).astimezone(UTC).replace(minute=0, second=0, microsecond=0) + timedelta(
        hours=1
    )
    start = end - timedelta(hours=1 + hours_back)
    query = f"starting_on={start:%Y-%m-%dT%H:%M:%SZ}&ending_before={end:%Y-%m-%dT%H:%M:%SZ}"
    return start, end, query


def test_tinker_usage_events_bucket_tokens_by_class_with_their_cost(
    app: SecureApp, priced: str
) -> None:
    tenant = new_tenant(app)
    model = new_model(app, tenant.key)
    set_prices(app, priced, train="0.3", sample="0.4")
    charge(app, model, priced, tenant.key_id, train=1000, sample=10, prefill=5)
    charge(app, model, priced, tenant.key_id, train=500)
    start, _, query = hour_window(app)
    body = ok(app.call("GET", f"/api/v1/billing/usage/events?{query}", tenant.key))
    response = types.BillingUsageResponse.model_validate(body)  # the SDK's own type
    events = {e.event_info.type: e for e in response.data}
    assert {t: e.event_info.token_count for t, e in events.items()} == {  # type: ignore[union-attr]
        "training": 1500,
        "sampling_sample": 10,
        "sampling_prefill": 5,
    }
    assert events["training"].estimated_cost_usd == pytest.approx(0.00045)
    assert events["training"].effective_rate_usd_per_million_tokens == pytest.approx(0.3)
    assert events["sampling_prefill"].estimated_cost_usd is None  # unpriced
    assert (
        events["training"].bucket_start <= datetime.now(UTC)
        and events["training"].bucket_start >= start
    )
    client_session = model.split(":")[0]
    assert events["training"].session_id == client_session
    assert client_session in response.sessions


def test_tinker_usage_events_need_hour_aligned_times(app: SecureApp) -> None:
    query = "starting_on=2026-01-01T00:30:00Z&ending_before=2026-01-01T02:00:00Z"
    body = ok(app.call("GET", f"/api/v1/billing/usage/events?{query}", new_tenant(app).key), 400)
    assert "hour boundary" in body["error"]["message"]


def test_checkpoint_storage_is_metered_in_gigabyte_hours(app: SecureApp) -> None:
    tenant = new_tenant(app)
    model = new_model(app, tenant.key)
    start, end, query = hour_window(app, hours_back=2)
    with app.engine.begin() as conn:  # 2 GB, live for exactly the window's first hour
        path = checkpoints.CheckpointPath(model, "weights", "kept-an-hour")
        checkpoints.register(
            conn,
            tenant_id=tenant.id,
            path=path,
            storage_prefix=f"tenants/{tenant.id}/x",
            size_bytes=2 * 10**9,
            has_optimizer=True,
            is_merged=False,
            ttl_seconds=None,
        )
        conn.execute(
            sa.text(
                "UPDATE checkpoints SET created_at = :a, deleted_at = :b WHERE tinker_path = :p"
            ),
            {"a": start, "b": start + timedelta(hours=1), "p": str(path)},
        )
    body = ok(app.call("GET", f"/api/v1/billing/usage/events?{query}", tenant.key))
    storage = [e for e in body["data"] if e["event_info"]["type"] == "storage"]
    assert [(e["bucket_start"], e["event_info"]["gigabyte_hours"]) for e in storage] == [
        (f"{start:%Y-%m-%dT%H:%M:%SZ}", 2.0)
    ]
    assert storage[0]["event_info"]["free"] is False
    saved = [e for e in body["data"] if e["event_info"]["type"] == "checkpoint"]
    assert [(e["bucket_start"], e["event_info"]["count"]) for e in saved] == [
        (f"{start:%Y-%m-%dT%H:%M:%SZ}", 1)
    ]


def test_recovery_checkpoints_are_free_storage(app: SecureApp) -> None:
    tenant = new_tenant(app)
    model = new_model(app, tenant.key)
    start, _, query = hour_window(app, hours_back=2)
    point = auto_checkpoints.AutoCheckpoint(
        session_id=model,
        seq_id=5,
        kind=auto_checkpoints.AUTO,
        storage_prefix="x",
        state={},
        size_bytes=10**9,
    )
    with app.engine.begin() as conn:  # 1 GB, live for the window's first half hour
        auto_checkpoints.record(conn, tenant_id=tenant.id, checkpoint=point)
        conn.execute(
            sa.text(
                "UPDATE auto_checkpoints SET created_at = :a, deleted_at = :b WHERE session_id = :s"
            ),
            {"a": start, "b": start + timedelta(minutes=30), "s": model},
        )
    body = ok(app.call("GET", f"/api/v1/billing/usage/events?{query}", tenant.key))
    storage = [e["event_info"] for e in body["data"] if e["event_info"]["type"] == "storage"]
    assert storage == [{"type": "storage", "free": True, "gigabyte_hours": 0.5}]


def test_current_checkpoint_storage_counts_live_checkpoints(app: SecureApp) -> None:
    tenant = new_tenant(app)
    model = new_model(app, tenant.key)
    with app.engine.begin() as conn:
        for name in ("one", "two"):
            checkpoints.register(
                conn,
                tenant_id=tenant.id,
                path=checkpoints.CheckpointPath(model, "weights", name),
                storage_prefix=f"tenants/{tenant.id}/{name}",
                size_bytes=1500,
                has_optimizer=True,
                is_merged=False,
                ttl_seconds=None,
            )
    body = ok(app.call("GET", "/api/v1/billing/usage/checkpoints/current", tenant.key))
    response = types.CurrentCheckpointStorageUsageResponse.model_validate(body)
    assert [(d.checkpoint_count, d.size_bytes, d.org_user_urn) for d in response.data] == [
        (2, 3000, tenant.key_id)
    ]
