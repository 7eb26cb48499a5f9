"""The sampler-vs-trainer KL metrics of a forward_backward, against tinker-cookbook 0.6.1's own
`compute_kl_sample_train` and a written-out formula.

The cookbook computes, over the action tokens (`mask > 0`), d = sampler_lp - trainer_lp,
v1 = mean(d) and v2 = 0.5 * mean(d^2). Its mask is stripped before sending; the engine takes a
token as an action unless its `weights` entry is 0 or its provenance marks it a prompt token.
The `:sum` totals add up across passes and requests.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from engine_support import new_adapter, randomise_b
from tinker_cookbook.rl.metrics import compute_kl_sample_train

from treadle.engine import Engine, EngineDatum, LoraSpec

SMALL_LORA = LoraSpec(rank=2, alpha=4.0, seed=11)
RNG = np.random.default_rng(0)


def rl_datum(n: int, weights: list[float] | None, sampled: list[int] | None) -> EngineDatum:
    inputs = {
        "target_tokens": RNG.integers(0, 49152, n),
        "logprobs": RNG.uniform(-12.0, -0.1, n).astype(np.float32),
        "advantages": RNG.normal(0.0, 1.0, n).astype(np.float32),
    }
    if weights is not None:
        inputs["weights"] = np.asarray(weights, np.float32)
    return EngineDatum(
        tuple(int(t) for t in RNG.integers(0, 49152, n)),
        inputs,
        sampled_targets=None if sampled is None else np.asarray(sampled, bool),
    )


DATA = [
    rl_datum(5, [0.0, 0.0, 1.0, 1.0, 1.0], None),  # a prompt of 2, then 3 actions
    rl_datum(4, None, [0, 1, 1, 0]),  # cookbook-style: no weights, provenance marks actions
    rl_datum(6, [1.0, 0.5, 0.0, 1.0, 1.0, 1.0], [0, 1, 1, 1, 1, 1]),
]


def cookbook_mask(d: EngineDatum) -> np.ndarray:
    mask = np.ones(len(d.tokens), np.float32)
    if "weights" in d.loss_fn_inputs:
        mask *= d.loss_fn_inputs["weights"] > 0
    if d.sampled_targets is not None:
        mask *= d.sampled_targets
    return mask


def test_kl_sample_train_matches_the_cookbook(engine: Engine) -> None:
    adapter = new_adapter(engine, SMALL_LORA)
    randomise_b(engine, adapter, seed=2)
    out = engine.forward_backward(adapter, DATA, "importance_sampling")

    trainer = [o["logprobs"] for o in out.outputs]
    cookbook_data = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints(list(d.tokens)),
            loss_fn_inputs={
                "logprobs": tinker.TensorData.from_numpy(d.loss_fn_inputs["logprobs"]),
                "mask": tinker.TensorData.from_numpy(cookbook_mask(d)),
            },
        )
        for d in DATA
    ]
    cookbook = compute_kl_sample_train(cookbook_data, [torch.from_numpy(t) for t in trainer])
    assert out.metrics["kl_sample_train_v1:mean"] == pytest.approx(
        cookbook["optim/kl_sample_train_v1"], rel=1e-6
    )
    assert out.metrics["kl_sample_train_v2:mean"] == pytest.approx(
        cookbook["optim/kl_sample_train_v2"], rel=1e-6
    )
    # written out: 3 + 2 + 4 action tokens
    d = np.concatenate(
        [
            (x.loss_fn_inputs["logprobs"] - t)[cookbook_mask(x) > 0].astype(np.float64)
            for x, t in zip(DATA, trainer, strict=True)
        ]
    )
    assert d.size == 9 and out.metrics["kl_sample_train/tokens:sum"] == 9
    assert out.metrics["kl_sample_train/v1_total:sum"] == pytest.approx(d.sum(), rel=1e-6)
    assert out.metrics["kl_sample_train/v2_total:sum"] == pytest.approx(
        0.5 * (d**2).sum(), rel=1e-6
    )
    assert out.metrics["kl_sample_train_v1:mean"] == pytest.approx(d.mean(), rel=1e-6)


def test_kl_totals_add_up_across_passes_and_requests(engine: Engine) -> None:
    adapter = new_adapter(engine, SMALL_LORA)
    randomise_b(engine, adapter, seed=3)
    whole = engine.forward_backward(adapter, DATA, "ppo", forward_only=True).metrics
    passes = engine.forward_backward(
        adapter, DATA, "ppo", forward_only=True, pass_tokens=6
    ).metrics  # three passes, one datum each
    parts = [
        engine.forward_backward(adapter, DATA[:1], "ppo", forward_only=True).metrics,
        engine.forward_backward(adapter, DATA[1:], "ppo", forward_only=True).metrics,
    ]
    for key in ("kl_sample_train_v1:mean", "kl_sample_train_v2:mean"):
        assert passes[key] == pytest.approx(whole[key], rel=1e-5)
    for key in ("v1_total", "v2_total", "tokens"):
        name = f"kl_sample_train/{key}:sum"
        assert sum(p[name] for p in parts) == pytest.approx(whole[name], rel=1e-5)
    combined = parts[0]["kl_sample_train/v1_total:sum"] + parts[1]["kl_sample_train/v1_total:sum"]
    assert combined / 9 == pytest.approx(whole["kl_sample_train_v1:mean"], rel=1e-5)


def test_no_kl_metric_without_sampler_logprobs(engine: Engine) -> None:
    adapter = new_adapter(engine, SMALL_LORA)
    datum = EngineDatum(
        (1, 2, 3), {"target_tokens": np.asarray([2, 3, 4]), "weights": np.ones(3, np.float32)}
    )
    metrics = engine.forward_backward(adapter, [datum], "cross_entropy").metrics
    assert list(metrics) == ["loss:sum"]


def test_stable_reinforce_takes_the_recorded_sampler_logprobs(engine: Engine) -> None:
    """stable_reinforce reads the recorded logprobs (NaN: a prompt target), not the `logprobs`
    the client sends: the KL counts the recorded sampled targets against those."""
    adapter = new_adapter(engine, SMALL_LORA)
    recorded = np.asarray([np.nan, -2.0, -0.5, -1.25], np.float32)
    datum = EngineDatum(
        (4, 8, 15, 16),
        {
            "target_tokens": np.asarray([8, 15, 16, 23]),
            "advantages": np.asarray([0.0, 1.0, -1.0, 0.5], np.float32),
            "logprobs": np.zeros(4, np.float32),  # sent, and not read
        },
        sampler_logprobs=recorded,
    )
    out = engine.forward_backward(adapter, [datum], "stable_reinforce", forward_only=True)
    d = (recorded - out.outputs[0]["logprobs"])[1:].astype(np.float64)
    assert out.metrics["kl_sample_train/tokens:sum"] == 3
    assert out.metrics["kl_sample_train_v1:mean"] == pytest.approx(d.mean(), rel=1e-6)
    assert out.metrics["kl_sample_train_v2:mean"] == pytest.approx(0.5 * (d**2).mean(), rel=1e-6)
