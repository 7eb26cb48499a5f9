"""Treadle's SDK settings, and its budget refusals raised from the tinker SDK's (no network)."""

from __future__ import annotations

import asyncio
import pickle
from concurrent.futures import Future
from typing import Any

import httpx
import pytest
import tinker
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

import treadle
from treadle.client.refusals import translated


def test_missing_api_key_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TREADLE_API_KEY", "TINKER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(treadle.ConfigurationError, match="TREADLE_API_KEY"):
        treadle.ServiceClient(base_url="http://127.0.0.1:1")


def test_environment_supplies_url_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_BASE_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("TREADLE_API_KEY", "tml-from-env-123456")
    svc = treadle.ServiceClient()
    assert svc.base_url == "http://127.0.0.1:9"
    assert svc.api_key == "tml-from-env-123456"


def test_sdk_reexports_the_types_users_need() -> None:
    datum = treadle.Datum(
        model_input=treadle.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
    )
    assert datum.model_input.to_ints() == [1, 2]
    assert treadle.AdamParams(learning_rate=1e-3).beta2 == 0.95
    assert treadle.SamplingParams(max_tokens=4).temperature == 1.0


def _billing_error(error: dict[str, Any]) -> tinker.BillingError:
    """The tinker SDK's error for a 402 answering `{"error": error}` (no network)."""
    body = {"error": error}
    request = httpx.Request("POST", "http://127.0.0.1:9/api/v1/forward_backward")
    response = httpx.Response(402, json=body, request=request)
    return tinker.BillingError(f"Error code: 402 - {body}", response=response, body=body)


TOKEN_REFUSAL = {
    "code": "quota_exceeded",
    "message": "this request may process 4 tokens; tenant acme has 8 of its 8 monthly tokens "
    "processed or held; wait for the next month or ask the operator to raise it",
    "limit": "monthly_tokens",
    "value": 8,
    "current": 8,
    "resets_at": "2026-08-01T00:00:00Z",
}


def test_a_budget_refusal_reads_as_the_platforms_message_with_its_limit() -> None:
    refusal = treadle.QuotaExceededError.of(_billing_error(TOKEN_REFUSAL))
    assert str(refusal) == (
        f"{TOKEN_REFUSAL['message']} [monthly_tokens: limit 8, used 8, "
        "resets at 2026-08-01T00:00:00Z]"
    )
    assert (refusal.limit, refusal.value, refusal.current, refusal.resets_at) == (
        "monthly_tokens", 8, 8, "2026-08-01T00:00:00Z",
    )  # fmt: skip
    assert isinstance(refusal, tinker.BillingError)
    assert refusal.status_code == 402


def test_a_spend_cap_refusal_shows_dollars_and_never_resets() -> None:
    error = {"code": "quota_exceeded", "message": "model m has spent its cap", "limit":
             "max_cost_usd", "value": 0.5, "current": 0.499999, "resets_at": None}  # fmt: skip
    refusal = treadle.QuotaExceededError.of(_billing_error(error))
    assert str(refusal) == (
        "model m has spent its cap [max_cost_usd: limit $0.5, used $0.499999, does not reset]"
    )


def test_a_budget_refusal_survives_pickling() -> None:
    refusal = treadle.QuotaExceededError.of(_billing_error(TOKEN_REFUSAL))
    copy = pickle.loads(pickle.dumps(refusal))
    assert type(copy) is treadle.QuotaExceededError
    assert (str(copy), copy.limit, copy.resets_at) == (str(refusal), "monthly_tokens",
                                                       "2026-08-01T00:00:00Z")  # fmt: skip


def test_a_refused_future_raises_quota_exceeded_from_the_sdks_error() -> None:
    source: Future[int] = Future()
    future = translated(AwaitableConcurrentFuture(source))
    original = _billing_error(TOKEN_REFUSAL)
    source.set_exception(original)
    with pytest.raises(treadle.QuotaExceededError, match="monthly_tokens: limit 8") as refused:
        future.result()
    assert refused.value.__cause__ is original
    with pytest.raises(treadle.QuotaExceededError):
        asyncio.run(future.result_async())


def test_a_translated_future_keeps_results_other_errors_and_cancellation() -> None:
    done: Future[int] = Future()
    done.set_result(3)
    assert translated(AwaitableConcurrentFuture(done)).result() == 3
    failed: Future[int] = Future()
    failed.set_exception(ValueError("datum 0: bad"))
    with pytest.raises(ValueError, match="datum 0: bad"):
        translated(AwaitableConcurrentFuture(failed)).result()
    running: Future[int] = Future()
    translated(AwaitableConcurrentFuture(running)).future().cancel()
    assert running.cancelled()  # cancelling the future cancels the operation
