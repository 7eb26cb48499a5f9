"""LoRA+ in the optimizer (`AdamSpec.lora_plus_lr_ratio`): every B matrix steps with
`learning_rate * k`, every A matrix with `learning_rate`. Checked against AdamW written out in
plain PyTorch (float64), against the single-group optimizer Treadle ran before LoRA+ (bit for
bit at k = 1, old optimizer state included), and through export/import and paging.

The first tests drive `TrainableLora` alone, with hand-made tensors and grads (no model); the
rest go through the engine on the tiny debug model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import DATA, TINY, new_adapter, randomise_b, train
from torch import nn

from treadle.engine import AdamSpec, Engine
from treadle.engine.lora import files as adapter_files
from treadle.engine.lora.adapters import LoraWeights, TrainableLora
from treadle.platform.errors import ValidationError

# weight decay and clipping on, so the ratio's reach into both is checked too
PLUS = AdamSpec(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0, lora_plus_lr_ratio=4.0)
PLAIN = AdamSpec(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
# The engine's grads have ~10^5 entries, whose float32 norm is ~1e-6 off the float64 one: the
# engine test leaves clipping out (the hand-made tests check it) to stay within 1e-6.
PLUS_UNCLIPPED = dataclasses.replace(PLUS, grad_clip_norm=0.0)
SHAPES = {"model.layers.0.self_attn.q_proj": (6, 4), "model.layers.0.mlp.up_proj": (5, 3)}
RANK = 2
STEPS = 4


def hand_weights(seed: int = 0) -> LoraWeights:
    """Two modules' A [rank, in] and B [out, rank], random, as trainable parameters."""
    g = torch.Generator().manual_seed(seed)
    a = {m: nn.Parameter(torch.randn(RANK, i, generator=g)) for m, (_, i) in SHAPES.items()}
    b = {m: nn.Parameter(torch.randn(o, RANK, generator=g)) for m, (o, _) in SHAPES.items()}
    return LoraWeights(scale=1.0, A=a, B=b)


def copy_of(weights: LoraWeights) -> LoraWeights:
    return LoraWeights(
        scale=weights.scale,
        A={m: nn.Parameter(t.detach().clone()) for m, t in weights.A.items()},
        B={m: nn.Parameter(t.detach().clone()) for m, t in weights.B.items()},
    )


def hand_grads(step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s grads, named as `tensors()` names them, magnitudes spread over 1e-3..10
    (the global norm is well above PLUS's clip norm of 1)."""
    g = torch.Generator().manual_seed(100 + step)
    out = {}
    for name, t in hand_weights().tensors():
        magnitude = torch.exp(torch.empty(t.shape).uniform_(-7.0, 2.3, generator=g))
        sign = torch.where(torch.rand(t.shape, generator=g) < 0.5, -1.0, 1.0)
        out[name] = sign * magnitude
    return out


def set_grads(weights: LoraWeights, grads: Mapping[str, torch.Tensor]) -> None:
    for name, t in weights.tensors():
        t.grad = grads[name].clone()


class WrittenOutAdamW:
    """AdamW as the papers write it, in float64: clip the grads' global norm, then per tensor
    with learning rate lr (lr * k for a LoRA B matrix): w <- w (1 - lr wd);
    m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
    w <- w - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self.w = {n: np.asarray(a, np.float64).copy() for n, a in weights.items()}
        self.m = {n: np.zeros_like(a) for n, a in self.w.items()}
        self.v = {n: np.zeros_like(a) for n, a in self.w.items()}
        self.t = 0

    def step(self, grads: Mapping[str, np.ndarray], adam: AdamSpec) -> None:
        self.t += 1
        g64 = {n: np.asarray(g, np.float64) for n, g in grads.items()}
        norm = math.sqrt(sum(float((g**2).sum()) for g in g64.values()))
        if adam.grad_clip_norm > 0:
            # torch's clip_grads_with_norm_: scale by max_norm / (norm + 1e-6), never above 1
            coef = min(1.0, adam.grad_clip_norm / (norm + 1e-6))
            g64 = {n: g * coef for n, g in g64.items()}
        b1, b2, t = adam.beta1, adam.beta2, self.t
        for name, g in g64.items():
            ratio = adam.lora_plus_lr_ratio if ".lora_B." in name else 1.0
            lr = adam.learning_rate * ratio
            self.w[name] *= 1 - lr * adam.weight_decay
            self.m[name] = b1 * self.m[name] + (1 - b1) * g
            self.v[name] = b2 * self.v[name] + (1 - b2) * g * g
            m_hat = self.m[name] / (1 - b1**t)
            v_hat = self.v[name] / (1 - b2**t)
            self.w[name] -= lr * m_hat / (np.sqrt(v_hat) + adam.eps)


def assert_close(actual: object, expected: np.ndarray, name: str, rel: float = 1e-6) -> None:
    """Within `rel` of the tensor's largest entry: a moment sums grads of both signs over the
    steps, so a small entry's relative error is the large ones' rounding, cancelled down."""
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0, atol=rel * scale, err_msg=name)


def legacy_step(weights: LoraWeights, optimizer: torch.optim.AdamW, adam: AdamSpec) -> None:
    """`TrainableLora.step` as it was before LoRA+: one AdamW parameter group for everything."""
    params = weights.parameters()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if adam.grad_clip_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, grad_norm)
    optimizer.param_groups[0].update(
        lr=adam.learning_rate,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        weight_decay=adam.weight_decay,
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def legacy_state(weights: LoraWeights, optimizer: torch.optim.AdamW) -> dict[str, dict]:
    """What `optimizer_state()` saved before LoRA+ (and what checkpoints of then hold)."""
    return {
        name: {k: v.detach().clone() for k, v in optimizer.state[p].items()}
        for name, p in weights.tensors()
        if optimizer.state.get(p)
    }


def assert_bitwise_equal(
    ours: LoraWeights, theirs: LoraWeights, our_state: Mapping, their_state: Mapping
) -> None:
    for (name, a), (_, b) in zip(ours.tensors(), theirs.tensors(), strict=True):
        assert torch.equal(a, b), name
    assert our_state.keys() == their_state.keys()
    for name, entries in their_state.items():
        assert our_state[name].keys() == entries.keys()
        for key, value in entries.items():
            assert torch.equal(our_state[name][key], value), f"{name}.{key}"


def test_steps_with_a_ratio_equal_written_out_adamw() -> None:
    weights = hand_weights()
    lora = TrainableLora(weights)
    reference = WrittenOutAdamW({n: t.detach().numpy() for n, t in weights.tensors()})
    for step in range(STEPS):
        grads = hand_grads(step)
        set_grads(weights, grads)
        metrics = lora.step(PLUS)
        reference.step({n: g.numpy() for n, g in grads.items()}, PLUS)
        assert metrics["learning_rate:mean"] == PLUS.learning_rate
        expected_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        assert metrics["grad_norm:mean"] == pytest.approx(expected_norm, rel=1e-6)
    state = lora.optimizer_state()
    for name, t in weights.tensors():
        np.testing.assert_allclose(t.detach().numpy(), reference.w[name], rtol=2e-6, atol=1e-7)
        assert_close(state[name]["exp_avg"], reference.m[name], f"{name}.exp_avg")
        assert_close(state[name]["exp_avg_sq"], reference.v[name], f"{name}.exp_avg_sq")
        assert float(state[name]["step"]) == STEPS


def test_a_ratio_moves_b_only() -> None:
    """The grads are given, so A's path does not depend on B: A ends bit for bit where k = 1
    leaves it, and each B's first update (no decay, no clipping) is k times as large."""
    runs = {}
    for ratio in (1.0, 4.0):
        weights = hand_weights()
        lora = TrainableLora(weights)
        set_grads(weights, hand_grads(0))
        lora.step(AdamSpec(learning_rate=1e-2, lora_plus_lr_ratio=ratio))
        runs[ratio] = weights
    start = dict(hand_weights().tensors())
    for (name, one), (_, four) in zip(runs[1.0].tensors(), runs[4.0].tensors(), strict=True):
        if ".lora_A." in name:
            assert torch.equal(one, four), name
        else:
            np.testing.assert_allclose(
                (four - start[name]).detach(), 4 * (one - start[name]).detach(), rtol=1e-4
            )


@pytest.mark.parametrize("adam", [PLAIN, AdamSpec(learning_rate=3e-3, lora_plus_lr_ratio=1.0)])
def test_ratio_one_is_the_single_group_optimizer_bit_for_bit(adam: AdamSpec) -> None:
    ours, theirs = hand_weights(), hand_weights()
    lora = TrainableLora(ours)
    legacy = torch.optim.AdamW(theirs.parameters())
    for step in range(STEPS):
        set_grads(ours, hand_grads(step))
        set_grads(theirs, hand_grads(step))
        lora.step(adam)
        legacy_step(theirs, legacy, adam)
    assert_bitwise_equal(ours, theirs, lora.optimizer_state(), legacy_state(theirs, legacy))


def test_optimizer_state_saved_before_lora_plus_loads_and_continues_exactly() -> None:
    """A checkpoint's optimizer state from the single-group optimizer (keyed by tensor name)
    loads into today's, which then steps exactly as the old one would have."""
    old = hand_weights()
    legacy = torch.optim.AdamW(old.parameters())
    for step in range(2):
        set_grads(old, hand_grads(step))
        legacy_step(old, legacy, PLAIN)
    restored = copy_of(old)
    lora = TrainableLora(restored)
    lora.load_optimizer_state(legacy_state(old, legacy))
    assert_bitwise_equal(restored, old, lora.optimizer_state(), legacy_state(old, legacy))
    for step in range(2, STEPS):
        set_grads(old, hand_grads(step))
        set_grads(restored, hand_grads(step))
        legacy_step(old, legacy, PLAIN)
        lora.step(PLAIN)
    assert_bitwise_equal(restored, old, lora.optimizer_state(), legacy_state(old, legacy))


def test_released_and_restored_adapter_keeps_its_groups() -> None:
    """Paging frees and restores the tensors in place: the B group still steps at lr * k."""
    paged, kept = hand_weights(), hand_weights()
    loras = TrainableLora(paged), TrainableLora(kept)
    for step in range(STEPS):
        for weights, lora in zip((paged, kept), loras, strict=True):
            set_grads(weights, hand_grads(step))
            lora.step(PLUS)
        saved = {k: v.clone() for k, v in loras[0].state_tensors().items()}
        loras[0].release()
        loras[0].restore(saved)
    assert_bitwise_equal(paged, kept, loras[0].optimizer_state(), loras[1].optimizer_state())


@pytest.mark.parametrize("ratio", [0.5, 0.0, -4.0, math.nan, math.inf])
def test_a_ratio_below_one_or_not_finite_is_refused(ratio: float) -> None:
    weights = hand_weights()
    before = [t.detach().clone() for t in weights.parameters()]
    with pytest.raises(ValidationError, match=r"lora_plus_lr_ratio .* must be a finite number"):
        TrainableLora(weights).step(AdamSpec(lora_plus_lr_ratio=ratio))
    for old, t in zip(before, weights.parameters(), strict=True):
        assert torch.equal(old, t)


# -- through the engine --------------------------------------------------------------------------


def exported_state(engine: Engine, adapter: str, folder: Path) -> adapter_files.SavedAdapter:
    engine.export_adapter(adapter, folder, with_optimizer=True)
    return adapter_files.read_adapter(folder, TINY, with_optimizer=True)


def test_engine_steps_with_a_ratio_equal_written_out_adamw(engine: Engine, tmp_path: Path) -> None:
    """Real grads from forward_backward; the engine picks out B by its peft name."""
    adapter = new_adapter(engine)
    randomise_b(engine, adapter, seed=7)  # B != 0, so A's grads are not 0
    reference = WrittenOutAdamW(engine.adapter_weights(adapter))
    for _ in range(3):
        engine.forward_backward(adapter, DATA, "cross_entropy")
        reference.step(engine.adapter_grads(adapter), PLUS_UNCLIPPED)
        engine.optim_step(adapter, PLUS_UNCLIPPED)
    saved = exported_state(engine, adapter, tmp_path)
    assert saved.optimizer is not None
    for name, weight in engine.adapter_weights(adapter).items():
        np.testing.assert_allclose(weight, reference.w[name], rtol=2e-6, atol=1e-7, err_msg=name)
        state = saved.optimizer[name]
        assert_close(state["exp_avg"], reference.m[name], f"{name}.exp_avg")
        assert_close(state["exp_avg_sq"], reference.v[name], f"{name}.exp_avg_sq")


def test_export_after_ratio_steps_continues_like_the_uninterrupted_run(
    engine: Engine, tmp_path: Path
) -> None:
    adapter = new_adapter(engine)
    randomise_b(engine, adapter, seed=8)
    train(engine, adapter, 2, adam=PLUS)
    engine.export_adapter(adapter, tmp_path, with_optimizer=True)
    restored = f"{adapter}-restored"
    engine.import_adapter(restored, TINY, tmp_path, with_optimizer=True)
    assert engine.state_hashes(restored) == engine.state_hashes(adapter)
    train(engine, adapter, 2, adam=PLUS)
    train(engine, restored, 2, adam=PLUS)
    assert engine.state_hashes(restored) == engine.state_hashes(adapter)
    for name, weight in engine.adapter_weights(restored).items():
        np.testing.assert_array_equal(weight, engine.adapter_weights(adapter)[name])


def interleaved(engine: Engine, ratios: Sequence[float]) -> list[str]:
    """One adapter per ratio, trained round robin (each paged out between its own calls when
    the engine holds one at a time)."""
    ids = [new_adapter(engine) for _ in ratios]
    for i, adapter in enumerate(ids):
        randomise_b(engine, adapter, seed=i)
    for step in range(3):
        for adapter, ratio in zip(ids, ratios, strict=True):
            engine.forward_backward(adapter, DATA[step:], "cross_entropy")
            engine.optim_step(adapter, AdamSpec(learning_rate=1e-2, lora_plus_lr_ratio=ratio))
    return ids


def test_paged_adapters_with_a_ratio_train_as_if_never_paged(
    cache_dir: Path, tmp_path: Path
) -> None:
    paged = Engine(cache_dir=cache_dir, device="cpu", max_loaded_adapters=1, spill_dir=tmp_path)
    ratios = (4.0, 16.0)
    ids = interleaved(paged, ratios)
    assert len(paged.spilled_adapters()) == 1
    unlimited = Engine(cache_dir=cache_dir, device="cpu")
    for ours, theirs in zip(ids, interleaved(unlimited, ratios), strict=True):
        assert paged.state_hashes(ours) == unlimited.state_hashes(theirs)
