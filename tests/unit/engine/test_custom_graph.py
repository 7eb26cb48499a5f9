"""A server-side custom loss (create_custom_loss's graph, as the tinker SDK encodes it) run by the
engine in the forward_backward's own pass, against plain PyTorch: the loss written out here on
the reference's logprobs (bare model + hand LoRA, engine_support), differentiated w.r.t. its own
A and B. Loss, metrics, logprobs and LoRA grads within 1e-5 (CPU, float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_support import DATA, reference_logprobs
from test_losses_exact import assert_same_grads, prepared_adapter
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from treadle.engine import Engine, EngineDatum
from treadle.platform.errors import ValidationError
from treadle.platform.models import custom_losses

BETA = 0.5


def sided(logprobs, weights, margin, side):  # type: ignore[no-untyped-def]
    reward = BETA * side * (torch.dot(logprobs, weights) - margin.sum())
    loss = -F.logsigmoid(reward) + 0.1 * logprobs.pow(2).mean()
    return loss, {"custom/reward:sum": reward, "custom/won:mean": (reward > 0).float()}


def recorded(fn: Any, ranks: dict[str, Any]) -> dict[str, Any]:
    """What a forward_backward's event records for `fn`, built as the API builds it."""
    graph = encode_graph(trace_loss(fn, ranks, "session")).model_dump(mode="json")
    content = custom_losses.validate_loss(fn.__name__, [dict(x) for x in _inputs(ranks)], graph)
    return {"loss_id": custom_losses.loss_id_of(content), **content}


def _inputs(ranks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": name, "rank": rank} for name, rank in ranks.items()]


RANKS = {"logprobs": 1, "weights": 1, "margin": 1, "side": 0}


def _data() -> list[EngineDatum]:
    gen = np.random.default_rng(3)
    out = []
    for i, d in enumerate(DATA[:3]):
        n = len(d.tokens)
        inputs = {
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "weights": d.loss_fn_inputs["weights"],
            "margin": gen.normal(-3.0, 1.0, n).astype(np.float32),
            "side": np.asarray(1.0 if i % 2 == 0 else -1.0, np.float32),
        }
        out.append(EngineDatum(d.tokens, inputs))
    return out


def test_a_custom_graph_runs_in_one_pass_and_matches_direct_pytorch(
    engine: Engine, cache_dir: Path
) -> None:
    adapter, hand = prepared_adapter(engine, seed=9)
    data = _data()
    out = engine.forward_backward(adapter, data, "custom", custom_loss=recorded(sided, RANKS))

    total = torch.zeros(())
    rewards, won = 0.0, 0.0
    for i, d in enumerate(data):
        lp = reference_logprobs(cache_dir, d.tokens, d.loss_fn_inputs["target_tokens"], hand)
        np.testing.assert_allclose(out.outputs[i]["logprobs"], lp.detach(), rtol=1e-5, atol=1e-5)
        x = {k: torch.from_numpy(np.asarray(v)) for k, v in d.loss_fn_inputs.items()}
        reward = BETA * x["side"] * ((lp * x["weights"]).sum() - x["margin"].sum())
        total = total + (-torch.log(torch.sigmoid(reward)) + 0.1 * (lp**2).mean())
        rewards += float(reward.detach())
        won += float(reward > 0)
    assert out.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-5)
    assert out.metrics["custom/reward:sum"] == pytest.approx(rewards, rel=1e-5)
    assert out.metrics["custom/won:mean"] == pytest.approx(won / len(data))
    assert set(out.outputs[0]) == {"logprobs"}  # the metrics' carriers are gone
    assert_same_grads(engine.adapter_grads(adapter), hand.grads(total))


def test_a_recorded_graph_whose_content_does_not_match_its_id_is_refused(engine: Engine) -> None:
    adapter, _ = prepared_adapter(engine, seed=1)
    loss = recorded(sided, RANKS)
    loss["nodes"] = [dict(n) for n in loss["nodes"]]
    next(n for n in loss["nodes"] if n["target"] == "torch.dot")["target"] = "torch.mul"
    with pytest.raises(ValidationError, match="does not match its content"):
        engine.forward_backward(adapter, _data(), "custom", custom_loss=loss)


def test_a_datum_missing_an_input_the_loss_reads_is_refused(engine: Engine) -> None:
    adapter, _ = prepared_adapter(engine, seed=1)
    data = _data()
    data[1] = EngineDatum(
        data[1].tokens, {k: v for k, v in data[1].loss_fn_inputs.items() if k != "margin"}
    )
    with pytest.raises(ValidationError, match="datum 1: loss_fn_inputs has no 'margin'"):
        engine.forward_backward(adapter, data, "custom", custom_loss=recorded(sided, RANKS))


def outer(logprobs, weights):  # type: ignore[no-untyped-def]
    square = logprobs.unsqueeze(1) * weights.unsqueeze(0)  # [T, T]
    cube = square.unsqueeze(2) * logprobs  # [T, T, T]
    return cube.sum(), {}


def test_a_graph_broadcasting_past_its_per_token_budget_is_refused_naming_the_node(
    engine: Engine,
) -> None:
    adapter, _ = prepared_adapter(engine, seed=1)
    long = EngineDatum(
        tuple(range(5, 80)),
        {
            "target_tokens": np.arange(6, 81, dtype=np.int64),
            "weights": np.ones(75, np.float32),
        },
    )
    loss = recorded(outer, {"logprobs": 1, "weights": 1})
    with pytest.raises(
        ValidationError, match=r"graph node 'mul' made a tensor of shape \[75, 75\]"
    ):
        engine.forward_backward(adapter, [long], "custom", custom_loss=loss)
