"""Stop means stop, and a refused request leaves no hole the next operation waits for."""

from __future__ import annotations

import time

import pytest
import tinker

import treadle
from tests.fault.conftest import Up
from tests.fault.loop import BASE_MODEL, batch

pytestmark = pytest.mark.fault


def test_stopping_a_session_cancels_its_long_sample_within_seconds(up: Up) -> None:
    up.wait_ready(2)
    svc = treadle.ServiceClient(base_url=up.base_url, api_key=up.admin_key)
    tc = svc.create_lora_training_client(BASE_MODEL, training_session_name="long-sample", rank=8)
    sc = tc.save_weights_and_get_sampling_client()
    params = treadle.SamplingParams(max_tokens=2000, temperature=1.0, seed=1, stop=[])
    future = sc.sample([1, 2, 3], num_samples=128, sampling_params=params)
    time.sleep(2)  # the sample is running on the worker
    stopped_at = time.monotonic()
    tc.stop()
    with pytest.raises(tinker.TinkerError, match="stopped"):
        future.result()
    assert time.monotonic() - stopped_at < 10
    # The worker is free again: another session's operation on it completes at once.
    other = svc.create_lora_training_client(BASE_MODEL, training_session_name="after", rank=8)
    started = time.monotonic()
    other.forward_backward(batch(0), loss_fn="cross_entropy").result()
    assert time.monotonic() - started < 10
    svc.close()


def test_a_refused_request_does_not_delay_the_next_operation(up: Up) -> None:
    up.wait_ready(2)
    svc = treadle.ServiceClient(base_url=up.base_url, api_key=up.admin_key)
    tc = svc.create_lora_training_client(BASE_MODEL, training_session_name="refused", rank=8)
    tc.forward_backward(batch(0), loss_fn="cross_entropy").result()
    with pytest.raises(tinker.TinkerError, match="loss"):
        tc.forward_backward(batch(1), loss_fn="cross_entropyy").result()
    started = time.monotonic()
    tc.forward_backward(batch(2), loss_fn="cross_entropy").result()
    tc.optim_step(treadle.AdamParams(learning_rate=1e-3)).result()
    assert time.monotonic() - started < 15  # the gap timeout is 60 s
    assert [e["type"] for e in up.events(tc.model_id, "OperationsSkipped")] == []
    svc.close()
