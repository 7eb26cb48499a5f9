"""Budget refusals (HTTP 402) as a training loop meets them. The tinker SDK pauses on a 402,
retrying every 5 s for `client/config`'s billing_exception_max_pause_duration_sec, which Treadle
sets to the operator's TREADLE_BILLING_PAUSE_SECONDS (default 0, not the SDK's hour): with the
default, a loop out of budget ends within seconds with the refusal, through the plain tinker
SDK and through Treadle's (a QuotaExceededError whose message is the platform's); with a pause
set, a loop that hits its budget waits, and goes on when the operator raises the quota. The
paused operation's seq_id, refused and remembered, is admitted when the SDK resends it.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import pytest
import sqlalchemy as sa
import tinker
from tinker import types

import treadle
from tests.conftest import Platform
from tests.fault.conftest import Up, start_up, wait_for
from tests.served_app import replica
from treadle.client.admin import AdminClient
from treadle.client.billing import BillingClient

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
TOKENS = 4  # model_input tokens of each step's one datum: its train tokens
BUDGET = 2 * TOKENS  # a month's tokens: the third step is refused
PAUSE_SECONDS = 60
SEED = 7
E = TypeVar("E", bound=BaseException)


def _datum(step: int) -> types.Datum:
    ids = [(3 + 5 * step + i) % 200 + 1 for i in range(TOKENS + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * TOKENS},
    )


def _step(tc: Any, step: int) -> float:
    """One step as a loop writes it: both operations sent, then both awaited; the loss."""
    fwd = tc.forward_backward([_datum(step)], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    loss = float(fwd.result().metrics["loss:sum"])
    opt.result()
    return loss


def _refused_step(tc: Any, expected: type[E]) -> tuple[E, float]:
    """The budget's two steps, then the third, which must raise `expected`: the error and how
    long the refused step took (from its send to the SDK giving up)."""
    for step in range(BUDGET // TOKENS):
        _step(tc, step)
    started = time.monotonic()
    with pytest.raises(expected) as refused:
        _step(tc, BUDGET // TOKENS)
    return refused.value, time.monotonic() - started


def _tenant(
    base_url: str, operator_key: str, label: str, monthly_tokens: int | None
) -> tuple[str, str]:
    """A new tenant (its id and admin key) with a monthly token budget, set by the operator."""
    tenant_id = f"budget-{label}-{secrets.token_hex(3)}"
    admin = AdminClient(base_url, operator_key)
    try:
        key = str(admin.create_tenant(tenant_id)["api_key"])
    finally:
        admin.close()
    if monthly_tokens is not None:
        _set_monthly_tokens(base_url, operator_key, tenant_id, monthly_tokens)
    return tenant_id, key


def _set_monthly_tokens(
    base_url: str, operator_key: str, tenant_id: str, tokens: int | None
) -> None:
    billing = BillingClient(base_url, operator_key)  # what `treadle quotas set` calls
    try:
        billing.set_quota(tenant_id, monthly_tokens=tokens)
    finally:
        billing.close()


def test_client_config_tells_the_sdk_the_default_pause_of_zero(platform: Platform) -> None:
    body = httpx.post(
        f"{platform.base_url}/api/v1/client/config",
        headers={"X-API-Key": platform.admin_key},
        json={},
        timeout=30,
    ).json()
    config = types.ClientConfigResponse.model_validate(body)  # as the SDK reads it
    assert config.billing_exception_max_pause_duration_sec == 0


def test_client_config_tells_the_sdk_the_configured_pause_in_whole_seconds(
    platform: Platform,
) -> None:
    with replica(platform, billing_pause_seconds=90.5) as (base_url, _):
        body = httpx.post(
            f"{base_url}/api/v1/client/config",
            headers={"X-API-Key": platform.admin_key},
            json={},
            timeout=30,
        ).json()
    config = types.ClientConfigResponse.model_validate(body)  # an int: 90.5 would not parse
    assert config.billing_exception_max_pause_duration_sec == 91


def test_a_tinker_loop_out_of_budget_ends_within_seconds(platform: Platform) -> None:
    _, key = _tenant(platform.base_url, platform.admin_key, "tinker", BUDGET)
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    try:
        tc = svc.create_lora_training_client(BASE_MODEL, rank=4).result()
        refused, elapsed = _refused_step(tc, tinker.BillingError)
    finally:
        svc.close("success").result()
    assert elapsed < 10, f"the loop waited {elapsed:.1f} s on the refusal"
    assert refused.status_code == 402
    assert "monthly_tokens" in str(refused)


def test_a_treadle_loop_out_of_budget_ends_within_seconds_with_the_refusal(
    platform: Platform,
) -> None:
    tenant_id, key = _tenant(platform.base_url, platform.admin_key, "treadle", BUDGET)
    svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
    try:
        tc = svc.create_lora_training_client(BASE_MODEL, rank=4)
        exc, elapsed = _refused_step(tc, treadle.QuotaExceededError)
    finally:
        svc.close()
    assert elapsed < 10, f"the loop waited {elapsed:.1f} s on the refusal"
    assert isinstance(exc, tinker.BillingError)  # code written for the tinker SDK catches it
    assert (exc.code, exc.limit, exc.value, exc.current) == (
        "quota_exceeded",
        "monthly_tokens",
        BUDGET,
        BUDGET,
    )
    assert exc.resets_at is not None and re.fullmatch(r"\d{4}-\d{2}-01T00:00:00Z", exc.resets_at)
    platform_message = exc.body["error"]["message"]  # type: ignore[index]
    assert f"tenant {tenant_id} has {BUDGET} of its {BUDGET} monthly tokens" in platform_message
    assert str(exc) == (
        f"{platform_message} [monthly_tokens: limit {BUDGET}, used {BUDGET}, "
        f"resets at {exc.resets_at}]"
    )


@pytest.fixture(scope="module")
def paused_up() -> Iterator[Up]:
    """A platform of its own whose clients pause on a 402 for PAUSE_SECONDS."""
    with start_up(workers=1, env={"TREADLE_BILLING_PAUSE_SECONDS": str(PAUSE_SECONDS)}) as up:
        yield up


def _refused(up: Up, model_id: str) -> bool:
    """Whether a training seq_id of the session stands refused at admission (not yet admitted
    on a resend)."""
    with up.db.connect() as conn:
        return bool(
            conn.execute(
                sa.text("SELECT count(*) FROM refused_seqs WHERE session_id = :s"),
                {"s": model_id},
            ).scalar_one()
        )


def _budget_refusals(up: Up) -> float:
    """The 402s for a monthly token budget that the platform's API has answered."""
    text = httpx.get(f"{up.base_url}/metrics", timeout=30).text
    found = re.search(
        r'^treadle_quota_rejections_total\{reason="monthly_tokens"\} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


def _train(
    up: Up, key: str, steps: int, operator: Callable[[str], None] | None = None
) -> tuple[str, list[float]]:
    """`steps` steps of a fresh session (seeded) through Treadle's SDK, while `operator` runs
    in another thread with the session's id; the session's id and its losses."""
    svc = treadle.ServiceClient(base_url=up.base_url, api_key=key)
    try:
        tc = svc.create_lora_training_client(BASE_MODEL, rank=4, seed=SEED)
        with ThreadPoolExecutor(1) as pool:
            raised = None if operator is None else pool.submit(operator, tc.model_id)
            losses = [_step(tc, step) for step in range(steps)]
            if raised is not None:
                raised.result()
    finally:
        svc.close()
    return tc.model_id, losses


@pytest.mark.own_services
def test_a_paused_loop_goes_on_when_the_operator_raises_the_quota(paused_up: Up) -> None:
    _, free_key = _tenant(paused_up.base_url, paused_up.admin_key, "unpaused", None)
    _, uninterrupted = _train(paused_up, free_key, 4)
    tenant_id, key = _tenant(paused_up.base_url, paused_up.admin_key, "paused", BUDGET)

    before = _budget_refusals(paused_up)

    def operator(model_id: str) -> None:
        # The loop's third forward_backward is refused, and refused again when its SDK resends
        # it 5 s later: with no pause the loop would end there; with one it keeps waiting.
        wait_for(
            lambda: _refused(paused_up, model_id) and _budget_refusals(paused_up) >= before + 2,
            PAUSE_SECONDS,
            "the refusal and its retry",
        )
        _set_monthly_tokens(paused_up.base_url, paused_up.admin_key, tenant_id, None)

    model_id, losses = _train(paused_up, key, 4, operator)
    # Every step ran, the paused one included, exactly as in a loop that never paused.
    assert losses == uninterrupted
    assert paused_up.events(model_id, "OperationsSkipped") == []
    assert not _refused(paused_up, model_id)
