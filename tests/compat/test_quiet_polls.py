"""Quiet long-polls: a user's loop whose operations outlast a long-poll logs no warning.

A long-poll that ends before the result answers 408 `{"type": "try_again"}`, which the tinker SDK
re-polls silently; a 200 `try_again` made it log "Retrying request ... because of try_again" at
WARNING on every poll (treadle/api/tinker/routes_futures.py). The loop runs the real SDK against a second
API replica of the served platform (same database, Redis and workers) whose long-poll lasts
0.2 s, so every operation outlasts several polls.
"""

from __future__ import annotations

import logging

import pytest
import tinker
from tinker import types

from tests.conftest import Platform, new_tenant_key
from tests.served_app import replica

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
LONG_POLL_SECONDS = 0.2
# The routes that answer a future, each resolved by exactly one successful retrieve_future.
FUTURE_ROUTES = ("/create_model", "/forward_backward", "/optim_step", "/save_weights_for_sampler",
                 "/asample")  # fmt: skip


def test_a_loop_longer_than_a_long_poll_logs_no_warning(
    platform: Platform, caplog: pytest.LogCaptureFixture
) -> None:
    key = new_tenant_key(platform, "quiet-polls")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, 40))),
        loss_fn_inputs={"target_tokens": list(range(2, 41)), "weights": [1.0] * 39},
    )
    with replica(platform, long_poll_seconds=LONG_POLL_SECONDS) as (base_url, counts):
        caplog.set_level(logging.DEBUG)  # every record, from every thread of the SDK
        service = tinker.ServiceClient(base_url=base_url, api_key=key)
        training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        for _ in range(3):
            training.forward_backward([datum] * 4, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=32, temperature=1.0, seed=0)
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, params).result()
        service.close("success").result()
    futures = sum(n for (path, _), n in counts.items() if path.endswith(FUTURE_ROUTES))
    polls = sum(n for (path, _), n in counts.items() if path == "/api/v1/retrieve_future")
    assert polls > futures, f"no long-poll ended before its result: {dict(counts)}"
    loud = [
        f"{r.name} {r.levelname}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("tinker")
    ]
    assert loud == []
    assert counts[("/api/v1/retrieve_future", 408)] == polls - futures  # each one that ended early
