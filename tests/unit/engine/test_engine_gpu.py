"""The engine's CUDA path: bfloat16 base weights, float32 adapters, residency on the device.

Every test here is marked `gpu` and runs on device "cuda"; the project's pytest configuration
deselects the marker where CUDA is absent. Tolerances are bfloat16's: the sampler's cached decode
and a full forward pass round differently.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import (
    DATA,
    GRAD_PROBE,
    PROMPT,
    TINY,
    ce_datum,
    logprobs,
    new_adapter,
    train,
)

from treadle.engine import Engine, LoraSpec, SamplingSpec
from treadle.platform.models.catalog import SMOLLM2_NAME

pytestmark = pytest.mark.gpu

TINY_LP_TOL = 0.02  # tiny-debug's logits are ~0.1: bf16 rounding moves its logprobs ~1e-3
SMOLLM2_LP_TOL = 0.25  # real logits of ~10-30 round to ~0.1 in bf16


@pytest.fixture(scope="module")
def engine(cache_dir: Path) -> Engine:
    return Engine(cache_dir=cache_dir, device="cuda")


def test_cuda_engine_runs_bf16_base_and_float32_adapters(engine: Engine) -> None:
    assert engine.device.type == "cuda" and engine.dtype == torch.bfloat16
    adapter = new_adapter(engine)
    assert engine.adapter_device(adapter).type == "cuda"
    out = engine.forward_backward(adapter, DATA, "cross_entropy")
    assert all(o["logprobs"].dtype == np.float32 for o in out.outputs)
    assert all(np.isfinite(g).all() for g in engine.adapter_grads(adapter).values())


def test_training_lowers_the_loss_on_cuda(engine: Engine) -> None:
    adapter = new_adapter(engine)
    losses = train(engine, adapter, 6)
    assert losses[-1] < losses[0] - 1.0
    metrics = engine.optim_step(adapter, GRAD_PROBE)
    assert np.isfinite(metrics["grad_norm:mean"])


def test_sample_logprobs_close_to_forward_logprobs_on_cuda(engine: Engine) -> None:
    adapter = new_adapter(engine)
    train(engine, adapter, 2)
    engine.snapshot(adapter, "gpu-lp-snap")
    params = SamplingSpec(max_tokens=8, temperature=1.0, seed=3, stop=())
    result = engine.sample(
        TINY, "gpu-lp-snap", PROMPT, 3, params, prompt_logprobs=True, topk_prompt_logprobs=4
    )
    assert result.prompt_logprobs is not None and result.topk_prompt_logprobs is not None
    for seq in result.sequences:
        assert len(seq.tokens) == 8 and seq.stop_reason == "length"
        lp = logprobs(engine, adapter, [ce_datum(PROMPT + seq.tokens)])[0]
        np.testing.assert_allclose(seq.logprobs, lp[len(PROMPT) - 1 :], atol=TINY_LP_TOL)
        np.testing.assert_allclose(
            result.prompt_logprobs[1:], lp[: len(PROMPT) - 1], atol=TINY_LP_TOL
        )
    assert [len(pairs) for pairs in result.topk_prompt_logprobs] == [0] + [4] * (len(PROMPT) - 1)


def test_greedy_and_seeded_sampling_reproduce_on_cuda(engine: Engine) -> None:
    greedy = SamplingSpec(max_tokens=6, temperature=0.0, stop=())
    first = engine.sample(TINY, None, PROMPT, 2, greedy).sequences
    assert (
        first[0].tokens
        == first[1].tokens
        == engine.sample(TINY, None, PROMPT, 1, greedy).sequences[0].tokens
    )

    def run(seed: int) -> list[list[int]]:
        params = SamplingSpec(max_tokens=6, temperature=1.0, seed=seed, stop=())
        return [s.tokens for s in engine.sample(TINY, None, PROMPT, 3, params).sequences]

    assert run(11) == run(11) and run(11) != run(12)


def test_idle_adapter_moves_to_host_memory_and_back(cache_dir: Path) -> None:
    engine = Engine(cache_dir=cache_dir, device="cuda", max_resident_adapters=1)
    adapter = new_adapter(engine)
    train(engine, adapter, 2, adam=GRAD_PROBE)
    engine.forward_backward(adapter, DATA[:2], "cross_entropy")  # grads pending over eviction
    before, pending = logprobs(engine, adapter, DATA), engine.adapter_grads(adapter)
    neighbour = new_adapter(engine)
    train(engine, neighbour, 1)
    assert engine.adapter_device(adapter).type == "cpu"
    assert engine.resident_adapters() == [neighbour]
    for x, y in zip(before, logprobs(engine, adapter, DATA), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    assert engine.adapter_device(adapter).type == "cuda"
    assert engine.adapter_device(neighbour).type == "cpu"
    for name, grad in engine.adapter_grads(adapter).items():
        np.testing.assert_array_equal(grad, pending[name], err_msg=name)
    engine.optim_step(adapter, GRAD_PROBE)  # Adam's moments came back with the weights
    train(engine, adapter, 1, adam=GRAD_PROBE)
    # The same history on an engine that never evicts.
    alone = Engine(cache_dir=cache_dir, device="cuda")
    reference = new_adapter(alone)
    train(alone, reference, 2, adam=GRAD_PROBE)
    alone.forward_backward(reference, DATA[:2], "cross_entropy")
    alone.optim_step(reference, GRAD_PROBE)
    train(alone, reference, 1, adam=GRAD_PROBE)
    ours, theirs = engine.adapter_weights(adapter), alone.adapter_weights(reference)
    for name, weight in ours.items():
        np.testing.assert_allclose(weight, theirs[name], rtol=0, atol=1e-5, err_msg=name)


def test_adapter_paged_out_from_the_device_comes_back_onto_it(
    cache_dir: Path, tmp_path: Path
) -> None:
    engine = Engine(cache_dir=cache_dir, device="cuda", max_loaded_adapters=1, spill_dir=tmp_path)
    adapter = new_adapter(engine)
    train(engine, adapter, 2, adam=GRAD_PROBE)
    engine.forward_backward(adapter, DATA[:2], "cross_entropy")  # grads pending over paging
    pending = engine.adapter_grads(adapter)
    neighbour = new_adapter(engine)  # pages `adapter` out, straight from the device
    assert list(engine.spilled_adapters()) == [adapter]
    engine.optim_step(adapter, GRAD_PROBE)
    assert engine.adapter_device(adapter).type == "cuda"
    assert list(engine.spilled_adapters()) == [neighbour]
    # The same history on an engine that never pages: the grads came back exactly, then the
    # same step on the same device.
    alone = Engine(cache_dir=cache_dir, device="cuda")
    reference = new_adapter(alone)
    train(alone, reference, 2, adam=GRAD_PROBE)
    alone.forward_backward(reference, DATA[:2], "cross_entropy")
    for name, grad in alone.adapter_grads(reference).items():
        np.testing.assert_allclose(pending[name], grad, rtol=0, atol=1e-6, err_msg=name)
    alone.optim_step(reference, GRAD_PROBE)
    ours, theirs = engine.adapter_weights(adapter), alone.adapter_weights(reference)
    for name, weight in ours.items():
        np.testing.assert_allclose(weight, theirs[name], rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_smollm2_trains_and_samples_in_bf16(cache_dir: Path) -> None:
    engine = Engine(cache_dir=cache_dir, device="cuda")
    tok = engine.tokenizer(SMOLLM2_NAME)
    chat = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ]
    tokens = tok.apply_chat_template(chat, return_dict=False)
    datum = ce_datum(tokens)
    engine.create_adapter("smollm2-gpu", SMOLLM2_NAME, LoraSpec(rank=8, alpha=16.0))
    losses = train(engine, "smollm2-gpu", 5, [datum])
    assert losses[-1] < losses[0]
    engine.snapshot("smollm2-gpu", "smollm2-gpu-snap")
    prompt = tokens[: len(tokens) // 2]
    params = SamplingSpec(max_tokens=8, temperature=1.0, seed=0, stop=())
    seq = engine.sample(SMOLLM2_NAME, "smollm2-gpu-snap", prompt, 1, params).sequences[0]
    forward = engine.forward_backward(
        "smollm2-gpu", [ce_datum(prompt + seq.tokens)], "cross_entropy", forward_only=True
    )
    lp = forward.outputs[0]["logprobs"][len(prompt) - 1 :]
    np.testing.assert_allclose(seq.logprobs, lp, atol=SMOLLM2_LP_TOL)
