"""Treadle's SDK settings (no network)."""

from __future__ import annotations

import pytest

import treadle


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
