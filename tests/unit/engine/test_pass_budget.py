"""The pass budget (engine/losses/passes.py): what it is on the CPU and, by its formula, on a GPU;
that the same budget gives the same bits and another budget other bits (why a replay must run
with the recorded one: tests/integration/test_lineage.py); and that a call's own budget wins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_support import ADAM, ce_datum, new_adapter
from transformers import LlamaConfig, LlamaForCausalLM

from treadle.engine import Engine
from treadle.engine.losses import passes
from treadle.engine.losses.chunked_logprobs import wants_checkpointing
from treadle.engine.losses.functions import MICROBATCH_LOGITS, MICROBATCH_TOKENS
from treadle.platform.errors import ValidationError

GIB = 2**30
# Two short data: together in one pass under the CPU's budget, one pass each under 4 tokens.
STEP_DATA = [ce_datum([1, 7, 3, 9, 4]), ce_datum([2, 8, 5])]


def _grads_after_steps(
    engine: Engine, pass_tokens: int | None, steps: int = 3
) -> list[torch.Tensor]:
    """`steps` forward_backward + optim_step rounds, then one more forward_backward: the
    accumulated grads (and through the steps, the weights) it leaves."""
    adapter = new_adapter(engine)
    out = None
    for _ in range(steps):
        out = engine.forward_backward(adapter, STEP_DATA, "cross_entropy", pass_tokens=pass_tokens)
        engine.optim_step(adapter, ADAM)
    assert out is None or out.pass_tokens == (pass_tokens or engine.pass_budget(adapter))
    engine.forward_backward(adapter, STEP_DATA, "cross_entropy", pass_tokens=pass_tokens)
    grads = [torch.from_numpy(g) for g in engine.adapter_grads(adapter).values()]
    grads += [torch.from_numpy(w) for w in engine.adapter_weights(adapter).values()]
    engine.drop_adapter(adapter)
    return grads


def test_the_cpu_budget_is_the_rule_the_engine_always_ran(engine: Engine) -> None:
    adapter = new_adapter(engine)
    vocab = 49_152  # the tiny debug model's (SmolLM2's tokenizer)
    assert engine.pass_budget(adapter) == min(MICROBATCH_TOKENS, MICROBATCH_LOGITS // vocab) == 682
    out = engine.forward_backward(adapter, STEP_DATA, "cross_entropy")
    assert out.pass_tokens == 682
    engine.drop_adapter(adapter)


def test_the_operators_setting_is_the_budget(cache_dir: Path) -> None:
    configured = Engine(cache_dir=cache_dir, device="cpu", microbatch_tokens=96)
    adapter = new_adapter(configured)
    assert configured.pass_budget(adapter) == 96
    assert configured.forward_backward(adapter, STEP_DATA, "cross_entropy").pass_tokens == 96


def test_the_same_budget_gives_the_same_bits_and_another_budget_other_bits(
    engine: Engine,
) -> None:
    """What makes recording the budget necessary: on the same data and seeds, the CPU's budget
    (both data in one pass) and a budget of 4 tokens (one pass each) end with other bits."""
    default = _grads_after_steps(engine, None)
    again = _grads_after_steps(engine, None)
    small = _grads_after_steps(engine, 4)
    small_again = _grads_after_steps(engine, 4)
    assert all(torch.equal(a, b) for a, b in zip(default, again, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(small, small_again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(default, small, strict=True))
    # The same up to float rounding: one forward_backward's grads (after optimizer steps, Adam
    # divides each grad by its own running size, so a near-zero one's rounding can move its
    # weight by up to the learning rate: seen past 1e-4 relative on one machine, not another).
    for a, b in zip(
        _grads_after_steps(engine, None, steps=0),
        _grads_after_steps(engine, 4, steps=0),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_budget_below_one_token_is_refused(engine: Engine) -> None:
    adapter = new_adapter(engine)
    with pytest.raises(ValidationError, match="pass_tokens is 0; it must be at least 1"):
        engine.forward_backward(adapter, STEP_DATA, "cross_entropy", pass_tokens=0)
    engine.drop_adapter(adapter)


def _llama_8b() -> LlamaForCausalLM:
    """Llama-3.1-8B's shape in bfloat16, on the meta device (no memory)."""
    config = LlamaConfig(
        vocab_size=128_256,
        hidden_size=4096,
        intermediate_size=14_336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def test_the_gpu_budget_follows_its_documented_formula() -> None:
    model = _llama_8b()  # on the meta device: the estimate (activation_cost.estimated_cost)
    # per layer: 20 hidden-sized bf16 values, and the bf16 inputs (the LoRA computes in the
    # activations' dtype) of q, k, v, o (4 x 4096), gate and up (2 x 4096) and down (14,336)
    per_layer = 20 * 4096 * 2 + (6 * 4096 + 14_336) * 2
    assert passes.token_bytes(model, checkpointed=False) == 32 * per_layer == 7_733_248
    checkpointed = 32 * 4096 * 2 + 20 * 4096 * 2 + (6 * 4096 + 14_336) * 2
    assert passes.token_bytes(model, checkpointed=True) == checkpointed
    weights = 16 * GIB
    free = 0.5 * (80 * GIB - weights) - 1.5 * GIB
    plain = int(free // 7_733_248)  # 4,234 tokens: 16x the 2^25-logits cap's 261
    assert passes.cuda_pass_tokens(model, 80 * GIB, weights, checkpointing=False) == plain == 4234
    forced = passes.cuda_pass_tokens(model, 80 * GIB, weights, checkpointing=True)
    assert forced == int(free // checkpointed) == 65_003
    # The engine's default runs passes plain, as many tokens as a pass it does not checkpoint
    # may hold: a quarter of the device (20 GiB / 7.7 MB a token = 2,776), not the 4,234 tokens
    # that would be checkpointed (32.7 GB), each recomputing its layers.
    default = passes.cuda_pass_tokens(model, 80 * GIB, weights, checkpointing=None)
    assert default == int(0.25 * 80 * GIB // 7_733_248) == 2776
    assert not wants_checkpointing(model, default, 80 * GIB)
    assert wants_checkpointing(model, default + 1, 80 * GIB)
    # A device with no room past the weights still runs passes, of one datum each.
    assert passes.cuda_pass_tokens(model, 17 * GIB, weights, checkpointing=None) == 1


def test_resident_bytes_count_the_weights_on_that_device_only() -> None:
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    every = sum(p.numel() * 4 for p in model.parameters())
    assert passes.resident_bytes([model], torch.device("cpu")) == every
    assert passes.resident_bytes([model], torch.device("meta")) == 0
