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

from treadle.engine import Engine, EngineDatum, LoraSpec
from treadle.engine.losses.functions import LOSSES
from treadle.platform.errors import ValidationError

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


# -- gspo: a sequence-level ratio, checked against the paper's gradient ---------------------------


def gspo_reference(
    lp_T: torch.Tensor,
    q_T: torch.Tensor,
    advantages_T: torch.Tensor,
    mask_T: torch.Tensor,
    lo: float,
    hi: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token (arXiv 2507.18071, eq. 13-14; tinker-docs.thinkingmachines.ai/tinker/losses/gspo):
    every token's ratio has the value of the sequence ratio s = exp(mean of lp - q over the
    marked tokens), and its gradient is s * grad(lp_t). Returns the elementwise loss
    -min(s·A_t, clip(s)·A_t) and a surrogate written from that gradient: a token contributes
    -A_t · s · lp_t when the unclipped term is the minimum (s inside [lo, hi] or clipping would
    raise the objective), nothing otherwise."""
    s = torch.exp((lp_T.detach() - q_T)[mask_T != 0].mean())
    clipped_s = s.clamp(lo, hi)
    value_T = -torch.minimum(s * advantages_T, clipped_s * advantages_T)
    unclipped_T = bool(lo <= s <= hi) | (s * advantages_T < clipped_s * advantages_T)
    surrogate = -(advantages_T * s * unclipped_T * lp_T).sum()
    return value_T, surrogate


def gspo_datum(
    tokens: Sequence[int],
    targets: Sequence[int],
    lp_T: torch.Tensor,
    ratios: Sequence[float],
    advantages: Sequence[float],
    mask: Sequence[float],
) -> EngineDatum:
    """A gspo datum whose "sampler" logprobs put each token's own ratio exactly at `ratios`."""
    q_T = lp_T.detach() - torch.log(torch.tensor(ratios))
    return EngineDatum(
        tuple(tokens),
        {
            "target_tokens": np.asarray(targets, np.int64),
            "logprobs": q_T.numpy().astype(np.float32),
            "advantages": np.asarray(advantages, np.float32),
            "sequence_ratio_mask": np.asarray(mask, np.float32),
        },
    )


@pytest.mark.parametrize(
    ("ratios", "advantages", "config"),
    [
        # s = sqrt(1.5 * 1.3) = 1.40 > 1.2: A > 0 clips, A < 0 does not; the unmarked first
        # token's own ratio (5) never enters s, but its advantage still counts
        ((5.0, 1.5, 1.3), (0.3, 1.0, -1.0), {}),
        ((0.2, 1.1, 0.95), (1.0, 0.5, -2.0), {}),  # s = 1.02, inside
        ((1.0, 0.6, 0.7), (1.0, -1.0, 1.0), {}),  # s = 0.65 < 0.8: A < 0 clips
        (
            (3.0, 1.01, 1.02),
            (1.0, 1.0, -1.0),
            {"clip_low_threshold": 0.99, "clip_high_threshold": 1.005},
        ),
    ],
    ids=["above", "inside", "below", "narrow"],
)
def test_gspo_matches_the_sequence_ratio_reference(
    engine: Engine,
    cache_dir: Path,
    ratios: Sequence[float],
    advantages: Sequence[float],
    config: dict[str, float],
) -> None:
    adapter, hand = prepared_adapter(engine, seed=21)
    lp_T = reference_logprobs(cache_dir, TOKENS, TARGETS, hand)
    mask = (0.0, 1.0, 1.0)
    datum = gspo_datum(TOKENS, TARGETS, lp_T, ratios, advantages, mask)
    x = {k: torch.from_numpy(v) for k, v in datum.loss_fn_inputs.items()}
    lo = config.get("clip_low_threshold", 0.8)
    hi = config.get("clip_high_threshold", 1.2)
    value_T, surrogate = gspo_reference(
        lp_T, x["logprobs"], x["advantages"], x["sequence_ratio_mask"], lo, hi
    )

    out = engine.forward_backward(adapter, [datum], "gspo", config)

    assert out.metrics["loss:sum"] == pytest.approx(float(value_T.sum()), rel=1e-5, abs=1e-5)
    np.testing.assert_allclose(out.outputs[0]["logprobs"], lp_T.detach().numpy(), **TOL)
    np.testing.assert_allclose(out.outputs[0]["elementwise_loss"], value_T.detach(), **TOL)
    assert_same_grads(engine.adapter_grads(adapter), hand.grads(surrogate))


def test_gspo_ratio_is_per_datum_in_a_padded_batch(engine: Engine, cache_dir: Path) -> None:
    """Two datums of different lengths in one padded pass: each keeps its own sequence ratio
    (one above the clip range, one below), and padding enters neither mean."""
    adapter, hand = prepared_adapter(engine, seed=22)
    long_tokens, long_targets = (7, 8, 9, 10, 11), (8, 9, 10, 11, 12)
    specs = [
        (TOKENS, TARGETS, (1.5, 1.5, 1.5), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)),
        (
            long_tokens,
            long_targets,
            (0.5, 0.6, 0.7, 9.0, 0.5),
            (1.0, -1.0, 2.0, 1.0, -0.5),
            (1, 1, 1, 0, 1),
        ),
    ]
    data, values, surrogates = [], [], []
    for tokens, targets, ratios, advantages, mask in specs:
        lp_T = reference_logprobs(cache_dir, tokens, targets, hand)
        datum = gspo_datum(tokens, targets, lp_T, ratios, advantages, mask)
        x = {k: torch.from_numpy(v) for k, v in datum.loss_fn_inputs.items()}
        value_T, surrogate = gspo_reference(
            lp_T, x["logprobs"], x["advantages"], x["sequence_ratio_mask"], 0.8, 1.2
        )
        data.append(datum)
        values.append(value_T)
        surrogates.append(surrogate)

    out = engine.forward_backward(adapter, data, "gspo")

    for got, value_T in zip(out.outputs, values, strict=True):
        np.testing.assert_allclose(got["elementwise_loss"], value_T.detach(), **TOL)
    total = float(sum(v.sum() for v in values))
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-5)
    assert_same_grads(engine.adapter_grads(adapter), hand.grads(surrogates[0] + surrogates[1]))


def test_per_token_clip_thresholds_override_the_config(engine: Engine, cache_dir: Path) -> None:
    """The tinker SDK types clip_low_threshold / clip_high_threshold as loss_fn_inputs: sent per
    token, they replace loss_fn_config's values for that datum's tokens."""
    adapter, hand = prepared_adapter(engine, seed=23)
    lp_T = reference_logprobs(cache_dir, TOKENS, TARGETS, hand)
    low_T, high_T = torch.tensor([0.9, 0.4, 0.8]), torch.tensor([1.6, 1.3, 1.02])
    q_T = lp_T.detach() - torch.log(torch.tensor(RATIOS))
    advantages_T = torch.tensor(ADVANTAGES)
    ratio_T = torch.exp(lp_T - q_T)
    # ppo, written out: token 0's ratio 1.5 is now inside [0.9, 1.6], token 1's 0.5 inside
    # [0.4, 1.3], token 2's 1.05 above [0.8, 1.02]
    expected_T = -torch.minimum(
        ratio_T * advantages_T, torch.clamp(ratio_T, low_T, high_T) * advantages_T
    )
    inputs = {
        "target_tokens": np.asarray(TARGETS, np.int64),
        "logprobs": q_T.numpy().astype(np.float32),
        "advantages": advantages_T.numpy(),
        "clip_low_threshold": low_T.numpy(),
        "clip_high_threshold": high_T.numpy(),
    }

    out = engine.forward_backward(adapter, [EngineDatum(TOKENS, inputs)], "ppo")

    np.testing.assert_allclose(out.outputs[0]["elementwise_loss"], expected_T.detach(), **TOL)
    np.testing.assert_allclose(out.outputs[0]["elementwise_loss"][:2], [-1.5, 0.5], **TOL)
    assert_same_grads(engine.adapter_grads(adapter), hand.grads(expected_T.sum()))


def _rl_datum(**extra: Sequence[float]) -> EngineDatum:
    inputs = {
        "target_tokens": np.asarray(TARGETS, np.int64),
        "logprobs": np.full(3, -1.0, np.float32),
        "advantages": np.ones(3, np.float32),
    }
    inputs.update({k: np.asarray(v, np.float32) for k, v in extra.items()})
    return EngineDatum(TOKENS, inputs)


@pytest.mark.parametrize(
    ("loss_fn", "datum", "message"),
    [
        ("stable_reinforce", _rl_datum(), "names no recorded sequence"),
        ("custom", _rl_datum(), "'custom'"),
        ("ppo", _rl_datum(sequence_ratio_mask=(1, 1, 1)), r"\['sequence_ratio_mask'\]"),
        ("importance_sampling", _rl_datum(clip_low_threshold=(0.8,) * 3), "does not read"),
        ("gspo", _rl_datum(), r"lacks \['sequence_ratio_mask'\]"),
        ("gspo", _rl_datum(sequence_ratio_mask=(0, 0, 0)), "sequence_ratio_mask marks no token"),
        ("ppo", _rl_datum(clip_high_threshold=(1.2, 11.0, 1.2)), "clip_high_threshold = 11.0"),
        (
            "cispo",
            _rl_datum(clip_low_threshold=(0.8, 0.8, 1.0), clip_high_threshold=(1.2, 1.2, 1.0)),
            "ok",
        ),
        (
            "cispo",
            _rl_datum(clip_low_threshold=(0.9, 0.9, 0.9), clip_high_threshold=(1.2, 1.0, 1.0)),
            "ok",
        ),
        (
            "gspo",
            _rl_datum(sequence_ratio_mask=(1, 0, 0), clip_low_threshold=(1.0, 1.0, 0.7)),
            "ok",
        ),
        ("ppo", _rl_datum(clip_low_threshold=(0.8, 1.5, 0.8)), "clip_low_threshold = 1.5"),
        ("importance_sampling", _rl_datum(weights=(0.0, 1.0, 0.5)), "ok"),
        ("ppo", _rl_datum(weights=(0.0, 1.0, 1.0)), "ok"),
        ("cispo", _rl_datum(weights=(2.0, 0.0, 0.25)), "ok"),
        (
            "dro",
            _rl_datum(weights=(1.0, 1.0, 1.0)),
            r"has \['weights'\], which loss 'dro' does not",
        ),
        (
            "gspo",
            _rl_datum(sequence_ratio_mask=(1, 1, 1), weights=(1.0, 1.0, 1.0)),
            r"has \['weights'\], which loss 'gspo' does not",
        ),
        ("ppo", _rl_datum(weights=(1.0, 0.0)), r"datum 0: weights has shape \[2\] but model_input"),
        ("cispo", _rl_datum(weights=(1.0, float("nan"), 1.0)), "datum 0: weights must hold finite"),
        (
            "importance_sampling",
            _rl_datum(weights=(float("inf"), 1.0, 1.0)),
            "datum 0: weights must hold finite",
        ),
    ],
    ids=[
        "stable-reinforce-unrecorded",
        "custom",
        "ppo-extra-input",
        "is-clip-input",
        "gspo-no-mask",
        "gspo-empty-mask",
        "clip-out-of-range",
        "clip-equal",
        "clip-ok",
        "gspo-clip",
        "clip-low-range",
        "is-weights",
        "ppo-weights",
        "cispo-weights",
        "dro-weights",
        "gspo-weights",
        "weights-length",
        "weights-nan",
        "weights-inf",
    ],
)
def test_loss_inputs_are_served_or_refused_by_name(
    engine: Engine, loss_fn: str, datum: EngineDatum, message: str
) -> None:
    adapter = new_adapter(engine)
    if message == "ok":
        out = engine.forward_backward(adapter, [datum], loss_fn, forward_only=True)
        assert np.isfinite(out.metrics["loss:sum"])
        return
    with pytest.raises(ValidationError, match=message):
        engine.forward_backward(adapter, [datum], loss_fn, forward_only=True)


# -- weights: a per-token mask on importance_sampling, ppo and cispo ------------------------------

MASKED_LOSSES = ("importance_sampling", "ppo", "cispo")
LONG_TOKENS, LONG_TARGETS = (7, 8, 9, 10, 11), (8, 9, 10, 11, 12)
# (ratio, advantage) per token of the second datum: ppo clips tokens 0, 1 and 3
LONG_RATIOS, LONG_ADVANTAGES = (0.5, 1.3, 1.0, 2.0, 0.9), (-1.0, 1.0, 0.5, 0.7, -2.0)
WEIGHTS = {
    # SageMaker's GSM8K example: 0 on prompt tokens, 1 on sampled ones
    "mask": ((0.0, 1.0, 1.0), (0.0, 0.0, 1.0, 1.0, 1.0)),
    "fractional": ((0.25, 1.5, 0.0), (2.0, 0.125, 0.3, 1.0, 0.6)),
}


def weighted_loss(
    loss_fn: str, lp: torch.Tensor, x: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """Each token's term times its weight w_t, written out per loss (docs/losses-and-sampling.md):
    -w·r·A, -w·min(r·A, clip(r)·A), -w·sg(clip(r))·lp·A."""
    w, adv, ratio = x["weights"], x["advantages"], torch.exp(lp - x["logprobs"])
    clipped = torch.clamp(
        ratio, config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    )
    if loss_fn == "importance_sampling":
        return -w * ratio * adv
    if loss_fn == "ppo":
        return -w * torch.minimum(ratio * adv, clipped * adv)
    assert loss_fn == "cispo"
    return -w * clipped.detach() * lp * adv


def rl_data(
    cache_dir: Path, hand: HandLora, weights: Sequence[Sequence[float]] | None
) -> tuple[list[EngineDatum], list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Two datums of different lengths (one padded pass) whose "sampler" logprobs put each
    token's ratio where RATIOS and LONG_RATIOS say, with `weights` (None: sent without); and
    their reference logprobs and inputs (weights all ones where not sent)."""
    data, lps, xs = [], [], []
    specs = ((TOKENS, TARGETS, RATIOS, ADVANTAGES), (LONG_TOKENS, LONG_TARGETS, LONG_RATIOS,
             LONG_ADVANTAGES))  # fmt: skip
    for i, (tokens, targets, ratios, advantages) in enumerate(specs):
        lp_T = reference_logprobs(cache_dir, tokens, targets, hand)
        q_T = lp_T.detach() - torch.log(torch.tensor(ratios))
        inputs = {
            "target_tokens": np.asarray(targets, np.int64),
            "logprobs": q_T.numpy().astype(np.float32),
            "advantages": np.asarray(advantages, np.float32),
        }
        if weights is not None:
            inputs["weights"] = np.asarray(weights[i], np.float32)
        x = {k: torch.from_numpy(v) for k, v in inputs.items() if k != "target_tokens"}
        x.setdefault("weights", torch.ones(len(targets)))
        data.append(EngineDatum(tuple(tokens), inputs))
        lps.append(lp_T)
        xs.append(x)
    return data, lps, xs


@pytest.mark.parametrize("weights", sorted(WEIGHTS))
@pytest.mark.parametrize("loss_fn", MASKED_LOSSES)
def test_weights_mask_each_token_like_the_written_out_reference(
    engine: Engine, cache_dir: Path, loss_fn: str, weights: str
) -> None:
    adapter, hand = prepared_adapter(engine, seed=31)
    data, lps, xs = rl_data(cache_dir, hand, WEIGHTS[weights])
    expected = [weighted_loss(loss_fn, lp_T, x, {}) for lp_T, x in zip(lps, xs, strict=True)]

    out = engine.forward_backward(adapter, data, loss_fn)

    total = sum(e.sum() for e in expected)
    assert out.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-5, abs=1e-5)
    for got, lp_T, expected_T, x in zip(out.outputs, lps, expected, xs, strict=True):
        np.testing.assert_allclose(got["logprobs"], lp_T.detach().numpy(), **TOL)
        np.testing.assert_allclose(got["elementwise_loss"], expected_T.detach(), **TOL)
        # a weight of 0 removes the token: its term is exactly 0 (its gradient with it)
        assert (got["elementwise_loss"][x["weights"].numpy() == 0] == 0).all()
    assert_same_grads(engine.adapter_grads(adapter), hand.grads(total))


@pytest.mark.parametrize("loss_fn", MASKED_LOSSES)
def test_all_ones_weights_equal_no_weights_bit_for_bit(
    engine: Engine, cache_dir: Path, loss_fn: str
) -> None:
    with_ones, without = prepared_adapter(engine, seed=32), prepared_adapter(engine, seed=32)
    ones = [np.ones(len(TARGETS)), np.ones(len(LONG_TARGETS))]
    sent, _, _ = rl_data(cache_dir, with_ones[1], ones)
    omitted, _, _ = rl_data(cache_dir, without[1], None)

    a = engine.forward_backward(with_ones[0], sent, loss_fn)
    b = engine.forward_backward(without[0], omitted, loss_fn)

    assert a.metrics == b.metrics
    for got, expected in zip(a.outputs, b.outputs, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            np.testing.assert_array_equal(got[key], expected[key])
    assert engine.state_hashes(with_ones[0]) == engine.state_hashes(without[0])
    grads = engine.adapter_grads(without[0])
    assert any(np.abs(g).max() > 0 for g in grads.values())


def test_a_mask_of_ones_leaves_each_formula_bit_for_bit() -> None:
    """The engine's loss functions with weights of 1 against the formulas as they were before
    the mask existed: values and gradients equal bit for bit (multiplying by 1.0 is exact)."""
    generator = torch.Generator().manual_seed(5)
    shape = (3, 17)
    x = {
        "logprobs": -torch.rand(shape, generator=generator) * 4,
        "advantages": torch.randn(shape, generator=generator),
        "clip_low_threshold": torch.full(shape, 0.8),
        "clip_high_threshold": torch.full(shape, 1.2),
        "weights": torch.ones(shape),
    }
    lp_start = x["logprobs"] + torch.randn(shape, generator=generator) * 0.3
    before = {
        "importance_sampling": lambda lp: -torch.exp(lp - x["logprobs"]) * x["advantages"],
        "ppo": lambda lp: (
            -torch.minimum(
                torch.exp(lp - x["logprobs"]) * x["advantages"],
                torch.clamp(torch.exp(lp - x["logprobs"]), 0.8, 1.2) * x["advantages"],
            )
        ),
        "cispo": lambda lp: (
            -torch.clamp(torch.exp(lp - x["logprobs"]).detach(), 0.8, 1.2) * lp * x["advantages"]
        ),
    }
    for name, formula in before.items():
        lp_new, lp_old = lp_start.clone().requires_grad_(), lp_start.clone().requires_grad_()
        new, old = LOSSES[name].compute(lp_new, x, {}), formula(lp_old)
        assert torch.equal(new, old), name
        upstream = torch.randn(shape, generator=generator)
        (grad_new,) = torch.autograd.grad(new, lp_new, upstream)
        (grad_old,) = torch.autograd.grad(old, lp_old, upstream)
        assert torch.equal(grad_new, grad_old), name


# -- stable_reinforce (Treadle's definition, docs/losses-and-sampling.md) --------------------

SR_TOL = 1e-6  # the bound: loss and grads within 1e-6 of the reference below


def stable_reinforce_reference(
    lp_T: torch.Tensor,
    sampler_lp_T: Sequence[float | None],
    advantages_T: Sequence[float],
    truncation: float = 2.0,
    mask_low: float = 0.0,
    mask_high: float = 10.0,
) -> torch.Tensor:
    """Written out per token: a sampled target's weight is its importance ratio against the
    recorded sampler logprob, capped at `truncation`, 0 outside [mask_low, mask_high], held
    constant; the token's loss is -weight * A * lp. A prompt target (None) contributes 0."""
    losses = []
    for t, q in enumerate(sampler_lp_T):
        if q is None:
            losses.append(lp_T[t] * 0.0)
            continue
        ratio = float(np.exp(float(lp_T[t].detach()) - q))
        weight = min(ratio, truncation) if mask_low <= ratio <= mask_high else 0.0
        losses.append(-weight * advantages_T[t] * lp_T[t])
    return torch.stack(losses)


@pytest.mark.parametrize(
    ("ratios", "advantages", "config"),
    [
        ((1.0, 1.0, 1.0), (1.0, -0.5, 0.7), {}),  # on-policy: plain REINFORCE
        ((3.0, 0.5, 20.0), (1.0, -1.0, 0.7), {}),  # stale: truncated, kept, masked
        ((None, 1.7, 0.2), (0.0, -1.0, 2.0), {"mask_low_threshold": 0.3}),  # a prompt target
        (
            (4.0, 1.5, 60.0),
            (0.5, 1.0, -1.0),
            {"truncation_threshold": 5.0, "mask_high_threshold": 50.0},
        ),  # fmt: skip
    ],
    ids=["on-policy", "stale", "prompt-target", "config"],
)
def test_stable_reinforce_matches_the_written_out_reference(
    engine: Engine,
    cache_dir: Path,
    ratios: Sequence[float | None],
    advantages: Sequence[float],
    config: dict[str, float],
) -> None:
    adapter, hand = prepared_adapter(engine, seed=23)
    lp_T = reference_logprobs(cache_dir, TOKENS, TARGETS, hand)
    # The recorded sampler logprobs that put each sampled target's ratio where `ratios` says.
    sampler_lp = [
        None if r is None else float(lp_T[t].detach()) - float(np.log(r))
        for t, r in enumerate(ratios)
    ]
    inputs = {
        "target_tokens": np.asarray(TARGETS, np.int64),
        "advantages": np.asarray(advantages, np.float32),
        "logprobs": np.full(3, 5.0, np.float32),  # the client's: ignored
    }
    recorded = np.asarray([np.nan if q is None else q for q in sampler_lp], np.float32)
    datum = EngineDatum(TOKENS, inputs, sampler_logprobs=recorded)
    # the reference reads the float32 values the engine reads
    recorded_values = [None if np.isnan(q) else float(q) for q in recorded]
    expected_T = stable_reinforce_reference(lp_T, recorded_values, advantages, *_sr_config(config))

    out = engine.forward_backward(adapter, [datum], "stable_reinforce", config)

    assert out.metrics["loss:sum"] == pytest.approx(
        float(expected_T.detach().sum()), rel=SR_TOL, abs=SR_TOL
    )
    np.testing.assert_allclose(
        out.outputs[0]["elementwise_loss"], expected_T.detach(), rtol=SR_TOL, atol=SR_TOL
    )
    expected_grads = hand.grads(expected_T.sum())
    grads = engine.adapter_grads(adapter)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        np.testing.assert_allclose(grads[name], grad, rtol=SR_TOL, atol=SR_TOL)
    assert max(float(np.abs(g).max()) for g in expected_grads.values()) > 1e-3


def _sr_config(config: dict[str, float]) -> tuple[float, float, float]:
    return (
        config.get("truncation_threshold", 2.0),
        config.get("mask_low_threshold", 0.0),
        config.get("mask_high_threshold", 10.0),
    )


def test_stable_reinforce_refuses_an_advantage_on_a_prompt_target(engine: Engine) -> None:
    datum = EngineDatum(
        TOKENS,
        {"target_tokens": np.asarray(TARGETS, np.int64), "advantages": np.ones(3, np.float32)},
        sampler_logprobs=np.asarray([np.nan, -1.0, -1.0], np.float32),
    )
    with pytest.raises(ValidationError, match=r"advantages\[0\] is nonzero .* prompt token"):
        engine.forward_backward(new_adapter(engine), [datum], "stable_reinforce")
