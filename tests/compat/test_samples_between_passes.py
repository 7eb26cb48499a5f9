"""A sample does not wait behind a long forward_backward: the worker runs the samples waiting on
its sessions between two passes of the training operation (worker/host.py, `_between_passes`),
so a sample sent while a forward_backward of many passes runs finishes before it, through the
unmodified tinker SDK against the served platform; and the forward_backward's outputs are
bit for bit those of a twin session that sampled nothing meanwhile.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import Platform, new_tenant_key

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
# 24 datums of 600 tokens: about 22 passes of the CPU's pass budget (682 tokens of a model with
# SmolLM2's vocabulary), seconds of work; a sample of 8 tokens costs a fraction of one pass.
DATUMS, LENGTH = 24, 600


@pytest.fixture(scope="module")
def service(platform: Platform) -> Iterator[tinker.ServiceClient]:
    svc = tinker.ServiceClient(
        base_url=platform.base_url, api_key=new_tenant_key(platform, "between-passes")
    )
    yield svc
    svc.close("success").result()


def long_batch() -> list[types.Datum]:
    rng = np.random.default_rng(3)
    data = []
    for _ in range(DATUMS):
        tokens = [int(t) for t in rng.integers(100, 5000, size=LENGTH + 1)]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * LENGTH},
            )
        )
    return data


def finished_at(future: object, times: dict[str, float], name: str) -> threading.Thread:
    def wait() -> None:
        future.result()  # type: ignore[attr-defined]
        times[name] = time.monotonic()

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


def test_a_sample_sent_during_a_long_forward_backward_finishes_before_it(
    service: tinker.ServiceClient,
) -> None:
    seed = secrets.randbelow(1000)
    tc = service.create_lora_training_client(BASE_MODEL, rank=4, seed=seed).result()
    twin = service.create_lora_training_client(BASE_MODEL, rank=4, seed=seed).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([504, 3575, 282, 4649])
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=4)
    alone = sampler.sample(prompt, 2, params).result()
    data = long_batch()

    times: dict[str, float] = {}
    training = tc.forward_backward(data, "cross_entropy")
    waiters = [finished_at(training, times, "forward_backward")]
    time.sleep(1.0)  # the forward_backward has begun its passes on the session's worker
    sample = sampler.sample(prompt, 2, params)
    waiters.append(finished_at(sample, times, "sample"))
    for waiter in waiters:
        waiter.join(timeout=300)
    assert times["sample"] < times["forward_backward"]
    # the sample is the one it gives alone: the passes around it did not touch it
    assert [s.tokens for s in sample.result().sequences] == [s.tokens for s in alone.sequences]

    # and the passes are the ones a session that sampled nothing computes
    interleaved = training.result()
    plain = twin.forward_backward(data, "cross_entropy").result()
    assert interleaved.metrics == plain.metrics
    for a, b in zip(interleaved.loss_fn_outputs, plain.loss_fn_outputs, strict=True):
        assert a["logprobs"].tolist() == b["logprobs"].tolist()
