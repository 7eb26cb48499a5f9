"""forward, forward_backward_custom and sampling through the plain tinker SDK and the platform."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

pytestmark = pytest.mark.integration

TOKENS = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282]


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


@pytest.fixture(scope="module")
def service(platform):
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=platform.admin_key)
    yield svc
    svc.close("success").result()


def test_forward_computes_logprobs_without_changing_state(service) -> None:
    tc = service.create_lora_training_client("treadle/tiny-debug", rank=4, seed=1).result()
    first = tc.forward([_datum(TOKENS)], "cross_entropy").result()
    second = tc.forward([_datum(TOKENS)], "cross_entropy").result()
    fb = tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    lp = first.loss_fn_outputs[0]["logprobs"].tolist()
    assert lp == second.loss_fn_outputs[0]["logprobs"].tolist()
    assert np.allclose(lp, fb.loss_fn_outputs[0]["logprobs"].tolist(), atol=1e-6)
    assert first.metrics["loss:sum"] == pytest.approx(-sum(lp), rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward([_datum(TOKENS)], "cross_entropy").result()
    assert after.loss_fn_outputs[0]["logprobs"].tolist() != lp


def test_forward_backward_custom_trains_a_squared_logprob_penalty(service) -> None:
    tc = service.create_lora_training_client("treadle/tiny-debug", rank=4, seed=2).result()

    def penalty(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum((lp**2).sum() for lp in logprobs)
        return loss, {"penalty:sum": float(loss.detach())}

    values = []
    for _ in range(4):
        out = tc.forward_backward_custom([_datum(TOKENS)], penalty)
        tc.optim_step(types.AdamParams(learning_rate=1e-2))
        values.append(out.result().metrics["penalty:sum"])
    assert values[-1] < values[0], values


def test_sampling_controls_through_the_api(service) -> None:
    tc = service.create_lora_training_client("treadle/tiny-debug", rank=4, seed=3).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(TOKENS[:4])

    def sample(n: int = 1, **params: object) -> types.SampleResponse:
        return sampler.sample(prompt, n, types.SamplingParams(**params)).result()

    greedy = sample(2, max_tokens=6, temperature=0.0)
    assert greedy.sequences[0].tokens == greedy.sequences[1].tokens
    assert len(greedy.sequences[0].tokens) == 6 and greedy.sequences[0].stop_reason == "length"
    assert sample(max_tokens=6, temperature=0.0).sequences[0].tokens == greedy.sequences[0].tokens
    seeded = [sample(max_tokens=8, seed=11).sequences[0].tokens for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert sample(max_tokens=8, seed=12).sequences[0].tokens != seeded[0]

    stop_token = greedy.sequences[0].tokens[2]
    stopped = sample(max_tokens=6, temperature=0.0, stop=[stop_token]).sequences[0]
    assert stopped.stop_reason == "stop" and stopped.tokens[-1] == stop_token
    assert len(stopped.tokens) <= 3

    free = sample(max_tokens=8, seed=5).sequences[0]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS[:4] + free.tokens)).result()
    assert np.allclose(scored[4:], free.logprobs, atol=1e-4)

    with_prompt = sampler.sample(
        prompt,
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    assert with_prompt.prompt_logprobs[0] is None
    assert np.allclose(with_prompt.prompt_logprobs[1:], scored[1:4], atol=1e-4)
    for position, top in enumerate(with_prompt.topk_prompt_logprobs[1:], start=1):
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1]
        actual = dict(top).get(TOKENS[position])
        if actual is not None:
            assert actual == pytest.approx(scored[position], abs=1e-4)
