"""Batched sampling on the platform changes no result: samples and prompt scores sent all at once
from several sessions (each its own trained adapter) through the unmodified tinker SDK, which the
workers decode together, equal the same requests sent one at a time."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import Platform
from treadle.client.admin import AdminClient

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
PROMPTS = [
    [504, 3575, 282, 4649, 314, 7042],
    [17, 4],
    [900, 12, 33, 41, 7, 7, 7, 120, 5, 66, 2],
    [3000],
]


@pytest.fixture(scope="module")
def samplers(platform: Platform) -> Iterator[list[tinker.SamplingClient]]:
    """Three sessions trained apart, so each sampler runs different weights."""
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"batching-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    out = []
    for n in range(3):
        tc = svc.create_lora_training_client(BASE_MODEL, rank=4 * (n + 1), seed=n).result()
        tokens = [7 + n, 11, 13 * (n + 1), 17, 19, 23, 29]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
        out.append(tc.save_weights_and_get_sampling_client().result())
    yield out
    svc.close("success").result()


def _requests(
    samplers: list[tinker.SamplingClient],
) -> list[tuple[tinker.SamplingClient, list[int], types.SamplingParams]]:
    """Every sampler on every prompt, with different lengths, temperatures and seeds."""
    return [
        (
            sampler,
            prompt,
            types.SamplingParams(
                max_tokens=3 + 2 * j,
                temperature=[1.0, 0.0, 0.7][i],
                top_p=0.9 if j % 2 else 1.0,
                seed=100 * i + j,
            ),
        )
        for i, sampler in enumerate(samplers)
        for j, prompt in enumerate(PROMPTS)
    ]


def _sample(
    sampler: tinker.SamplingClient, prompt: list[int], params: types.SamplingParams
) -> tinker.APIFuture[types.SampleResponse]:
    return sampler.sample(types.ModelInput.from_ints(prompt), 2, params)


def test_samples_sent_together_equal_samples_sent_alone(
    samplers: list[tinker.SamplingClient],
) -> None:
    requests = _requests(samplers)
    together = [_sample(*r) for r in requests]  # all in flight before any result is read
    batched = [f.result() for f in together]
    for request, out in zip(requests, batched, strict=True):
        alone = _sample(*request).result()
        assert [s.tokens for s in out.sequences] == [s.tokens for s in alone.sequences]
        for one, other in zip(out.sequences, alone.sequences, strict=True):
            np.testing.assert_allclose(one.logprobs or [], other.logprobs or [], atol=1e-5)
    first = [s.tokens for s in batched[0].sequences]
    assert any([s.tokens for s in out.sequences] != first for out in batched[1:])


def test_prompt_scores_sent_together_equal_scores_sent_alone(
    samplers: list[tinker.SamplingClient],
) -> None:
    pairs = [(s, p) for s in samplers for p in PROMPTS if len(p) > 1]
    together = [s.compute_logprobs(types.ModelInput.from_ints(p)) for s, p in pairs]
    batched = [f.result() for f in together]
    for (sampler, prompt), out in zip(pairs, batched, strict=True):
        alone = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
        assert out[0] is None and alone[0] is None
        np.testing.assert_allclose(out[1:], alone[1:], atol=1e-5)
    per_sampler = [batched[i * 3] for i in range(len(samplers))]  # the first prompt, each
    assert len({tuple(x) for x in per_sampler}) == len(samplers)  # the adapters differ


def test_a_sample_sent_while_a_batch_decodes_joins_it(
    samplers: list[tinker.SamplingClient],
) -> None:
    """A short sample sent well after a long one started (past the 2 s during which a batch
    once took joiners) joins the running batch between two decoding steps: it finishes first,
    instead of waiting for the long one's batch to end."""
    sampler = samplers[0]
    long_params = types.SamplingParams(max_tokens=1800, temperature=1.0, seed=3)
    short_params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=4)
    done: dict[str, float] = {}

    def run(name: str, params: types.SamplingParams) -> types.SampleResponse:
        out = _sample(sampler, PROMPTS[0], params).result()
        done[name] = time.monotonic()
        return out

    with ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        long = pool.submit(run, "long", long_params)
        time.sleep(2.5)
        assert "long" not in done, "the long sample must still be decoding"
        short = pool.submit(run, "short", short_params)
        short_out, long_out = short.result(), long.result()
    assert all(len(s.tokens) == 1800 for s in long_out.sequences)  # it ran to its length
    assert all(len(s.tokens) == 4 for s in short_out.sequences)
    assert done["short"] < done["long"], (done["short"] - started, done["long"] - started)


def test_a_batch_takes_no_more_samples_once_training_waits(platform: Platform) -> None:
    """Once a forward_backward waits on the worker, the running batch lets no new sample join
    (so a stream of samples cannot starve training): a short sample sent after it finishes
    after the long one its batch was decoding, and the forward_backward runs."""
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"no-join-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    trainer = svc.create_lora_training_client(BASE_MODEL, rank=4, seed=1).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    tokens = [7, 11, 13, 17, 19]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    done: dict[str, float] = {}

    def run(name: str, call: Callable[[], object]) -> object:
        out = call()
        done[name] = time.monotonic()
        return out

    long_params = types.SamplingParams(max_tokens=1800, temperature=1.0, seed=3)
    short_params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=4)
    with ThreadPoolExecutor(3) as pool:
        long = pool.submit(run, "long", lambda: _sample(sampler, PROMPTS[0], long_params).result())
        time.sleep(1.0)
        trained = pool.submit(
            run, "train", lambda: trainer.forward_backward([datum], "cross_entropy").result()
        )
        time.sleep(1.0)
        assert "long" not in done, "the long sample must still be decoding"
        short = pool.submit(
            run, "short", lambda: _sample(sampler, PROMPTS[0], short_params).result()
        )
        short.result(), long.result(), trained.result()
    assert done["short"] > done["long"]  # it did not join the long one's batch
    svc.close("success").result()
