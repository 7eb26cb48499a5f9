"""Every loss, and a custom loss through the SDK's construction, against plain PyTorch.

The reference runs the bare base model with the LoRA delta added by hand (engine_support), applies
the documented formula (reference/semantics.md) written out here, and differentiates w.r.t. its
own copies of A and B; the engine's reported loss, logprobs, elementwise losses and accumulated
LoRA grads must match it to 1e-5 (CPU, float32; grads relative to their largest entry, see
`assert_same_grads`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import (
    ADAM,
    DATA,
    HandLora,
    new_adapter,
    randomise_b,
    reference_logprobs,
)

from treadle.gpu_worker.engine import Engine, EngineDatum, LoraSpec

TOL = {"rtol": 1e-5, "atol": 1e-5}
SMALL_LORA = LoraSpec(rank=2, alpha=4.0, seed=11)  # scale 2: the delta is not negligible
TOKENS, TARGETS = (11, 2222, 333), (2222, 333, 44)


def documented_loss(
    loss_fn: str, lp: torch.Tensor, x: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """The elementwise loss of reference/semantics.md, written independently of the engine."""
    if loss_fn == "cross_entropy":
        return -x["weights"] * lp
    adv, q = x["advantages"], x["logprobs"]
    ratio = torch.exp(lp - q)
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if loss_fn == "importance_sampling":
        return -ratio * adv
    if loss_fn == "ppo":
        return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    if loss_fn == "cispo":
        return -torch.clamp(ratio, lo, hi).detach() * lp * adv
    assert loss_fn == "dro"
    return -(lp * adv - 0.5 * config.get("beta", 0.05) * (lp - q) ** 2)


def prepared_adapter(engine: Engine, seed: int) -> tuple[str, HandLora]:
    """A fresh adapter on every target with random B, and the reference's copy of it."""
    adapter = new_adapter(engine, SMALL_LORA)
    randomise_b(engine, adapter, seed)
    return adapter, HandLora(engine.adapter_weights(adapter), SMALL_LORA.alpha / SMALL_LORA.rank)


def assert_same_grads(engine_grads: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """Every grad within 1e-5, absolute below magnitude 1 and relative to the largest grad entry
    above it: an entry of a few tens is a float32 sum whose rounding alone is ~1e-5 (the engine
    runs a padded batch, the reference one sequence at a time)."""
    assert engine_grads.keys() == expected.keys()
    scale = max(1.0, max(float(np.abs(g).max()) for g in expected.values()))
    for name, grad in expected.items():
        np.testing.assert_allclose(engine_grads[name], grad, rtol=1e-5, atol=1e-5 * scale)
    a_norm = sum(float(np.abs(g).sum()) for n, g in expected.items() if ".lora_A." in n)
    assert a_norm > 1e-3  # B != 0, so the A grads are exercised too


RATIOS = (1.5, 0.5, 1.05)  # above the clip range, below it, inside it
ADVANTAGES = (1.0, -1.0, 0.7)  # ppo: the first two clip (r·A > hi·A and r·A > lo·A)


@pytest.mark.parametrize(
    ("loss_fn", "config", "advantages"),
    [
        ("cross_entropy", {}, None),
        ("importance_sampling", {}, ADVANTAGES),
        ("ppo", {}, ADVANTAGES),
        ("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}, (-1.0, 1.0, 0.7)),
        ("cispo", {}, ADVANTAGES),
        ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.0}, (-1.0, 1.0, 0.7)),
        ("dro", {"beta": 0.1}, ADVANTAGES),
    ],
    ids=["ce", "is", "ppo-clipped", "ppo-unclipped", "cispo", "cispo-narrow", "dro"],
)
def test_loss_and_lora_grads_match_plain_pytorch(
    engine: Engine,
    cache_dir: Path,
    loss_fn: str,
    config: dict[str, float],
    advantages: Sequence[float] | None,
) -> None:
    adapter, hand = prepared_adapter(engine, seed=len(loss_fn) + len(config))
    lp_T = reference_logprobs(cache_dir, TOKENS, TARGETS, hand)
    inputs: dict[str, np.ndarray] = {"target_tokens": np.asarray(TARGETS, np.int64)}
    if advantages is None:
        inputs["weights"] = np.asarray([1.0, -0.5, 2.25], np.float32)
    else:
        # The "sampler" logprobs that put each token's ratio exactly where RATIOS says.
        q_T = lp_T.detach() - torch.log(torch.tensor(RATIOS))
        inputs["logprobs"] = q_T.numpy().astype(np.float32)
        inputs["advantages"] = np.asarray(advantages, np.float32)
    x = {k: torch.from_numpy(v) for k, v in inputs.items() if k != "target_tokens"}
    expected_T = documented_loss(loss_fn, lp_T, x, config)

    out = engine.forward_backward(adapter, [EngineDatum(TOKENS, inputs)], loss_fn, config)

    assert out.metrics["loss:sum"] == pytest.approx(
        float(expected_T.detach().sum()), rel=1e-5, abs=1e-5
    )
    np.testing.assert_allclose(out.outputs[0]["logprobs"], lp_T.detach().numpy(), **TOL)
    np.testing.assert_allclose(out.outputs[0]["elementwise_loss"], expected_T.detach(), **TOL)
    assert_same_grads(engine.adapter_grads(adapter), hand.grads(expected_T.sum()))
    if loss_fn == "ppo" and not config:  # clipping really is active, in both directions
        # -min(r·A, clip(r)·A) with A = +1, -1: -min(1.5, 1.2) and -min(-0.5, -0.8)
        np.testing.assert_allclose(out.outputs[0]["elementwise_loss"][:2], [-1.2, 0.8], **TOL)


# -- custom losses, the way the tinker SDK sends them --------------------------------------------

CustomLoss = Callable[[list[torch.Tensor]], torch.Tensor]


def squared_logprob(lps: list[torch.Tensor]) -> torch.Tensor:
    """A squared-logprob penalty, as a mean over tokens (normalising is the client's job)."""
    return torch.cat(lps).pow(2).mean()


def squared_distance_to(targets: list[torch.Tensor]) -> CustomLoss:
    """Mean (lp - target)²: its weights -dC/dlp have both signs."""

    def loss(lps: list[torch.Tensor]) -> torch.Tensor:
        return (torch.cat(lps) - torch.cat(targets)).pow(2).mean()

    return loss


def forward_backward_custom(
    engine: Engine, adapter: str, data: Sequence[EngineDatum], fn: CustomLoss
) -> tuple[float, list[np.ndarray]]:
    """The SDK's client half: a forward pass, C(lp) with autograd locally, then a cross-entropy
    forward_backward with weights = -dC/dlp. Returns C and the weights sent."""
    forward = engine.forward_backward(adapter, data, "cross_entropy", forward_only=True)
    lps = [torch.tensor(o["logprobs"], requires_grad=True) for o in forward.outputs]
    loss = fn(lps)
    loss.backward()
    weights = [-lp.grad.numpy() for lp in lps if lp.grad is not None]
    linear = [
        EngineDatum(d.tokens, {"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": w})
        for d, w in zip(data, weights, strict=True)
    ]
    engine.forward_backward(adapter, linear, "cross_entropy")
    return float(loss.detach()), weights


def custom_losses(engine: Engine, adapter: str) -> dict[str, CustomLoss]:
    lps = engine.forward_backward(adapter, DATA[:2], "cross_entropy", forward_only=True).outputs
    middles = [
        torch.full_like(torch.from_numpy(o["logprobs"]), float(o["logprobs"].mean())) for o in lps
    ]
    return {"squared_logprob": squared_logprob, "squared_distance": squared_distance_to(middles)}


@pytest.mark.parametrize("name", ["squared_logprob", "squared_distance"])
def test_custom_loss_gradient_matches_direct_pytorch(
    engine: Engine, cache_dir: Path, name: str
) -> None:
    adapter, hand = prepared_adapter(engine, seed=5)
    fn = custom_losses(engine, adapter)[name]
    loss, weights = forward_backward_custom(engine, adapter, DATA[:2], fn)
    all_weights = np.concatenate(weights)
    assert not np.allclose(all_weights, np.round(all_weights))  # non-integer weights
    if name == "squared_distance":
        assert (all_weights < 0).any() and (all_weights > 0).any()

    direct = fn(
        [
            reference_logprobs(cache_dir, d.tokens, d.loss_fn_inputs["target_tokens"], hand)
            for d in DATA[:2]
        ]
    )
    assert loss == pytest.approx(float(direct.detach()), rel=1e-5)
    assert_same_grads(engine.adapter_grads(adapter), hand.grads(direct))


def test_custom_loss_trains_down(engine: Engine) -> None:
    adapter = new_adapter(engine)
    losses = []
    for _ in range(5):
        losses.append(forward_backward_custom(engine, adapter, DATA[:2], squared_logprob)[0])
        engine.optim_step(adapter, ADAM)
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))
    assert losses[-1] < 0.8 * losses[0]
