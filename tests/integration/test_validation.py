"""Every forward_backward rejection is a 400 naming the datum and field, and appends nothing."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from tinker import types

from tests.integration.wire_client import WireClient, datum

pytestmark = pytest.mark.integration


def rl_datum(n: int = 3, **override: Any) -> types.Datum:
    inputs: dict[str, Any] = {
        "target_tokens": list(range(2, 2 + n)),
        "logprobs": [-1.0] * n,
        "advantages": [1.0] * n,
    }
    inputs.update(override)
    inputs = {k: v for k, v in inputs.items() if v is not None}
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, 1 + n))), loss_fn_inputs=inputs
    )


def topk_datum(targets: list[list[int]], weights: list[list[float]], n: int = 3) -> types.Datum:
    """cross_entropy's top-K datum: [N, K] target_tokens and weights (as given)."""

    def tensor(rows: list[list[Any]], dtype: str) -> types.TensorData:
        flat = [v for row in rows for v in row]
        shape = [len(rows), len(rows[0])]
        return types.TensorData(data=flat, dtype=dtype, shape=shape)  # type: ignore[arg-type]

    return types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, 1 + n))),
        loss_fn_inputs={
            "target_tokens": tensor(targets, "int64"),
            "weights": tensor(weights, "float32"),
        },
    )


TOPK_IDS, TOPK_W = [[2, 3]] * 3, [[0.5, 0.5]] * 3


@pytest.fixture(scope="module")
def model(platform) -> tuple[WireClient, str]:
    client = WireClient(platform.base_url, platform.admin_key)
    return client, client.create_model()


def _event_count(engine: sa.Engine, model_id: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM events WHERE session_id = :s"), {"s": model_id}
            ).scalar_one()
        )


CASES = [
    ("unknown loss", "sft", [datum([1, 2, 3])], None, "unknown loss_fn 'sft'"),
    ("missing weights", "cross_entropy", [datum([1, 2, 3]), rl_datum()], None, "datum 1: loss_fn_inputs is missing 'weights'"),
    ("missing advantages", "ppo", [rl_datum(advantages=None)], None, "datum 0: loss_fn_inputs is missing 'advantages'"),
    ("mis-shaped logprobs", "importance_sampling", [rl_datum(logprobs=[-1.0, -1.0])], None, "datum 0: logprobs has shape [2]"),
    ("2-D advantages", "cispo", [rl_datum(advantages=types.TensorData(data=[1.0] * 6, dtype="float32", shape=[3, 2]))], None, "datum 0: advantages has shape [3, 2]"),
    ("unknown config key", "ppo", [rl_datum()], {"clip_epsilon": 0.2}, "unknown keys ['clip_epsilon']"),
    ("config on cross_entropy", "cross_entropy", [datum([1, 2, 3])], {"beta": 0.1}, "accepted keys: none"),
    ("clip low out of range", "ppo", [rl_datum()], {"clip_low_threshold": 1.5}, "clip_low_threshold'] = 1.5 is out of range for ppo; it must be between 0.0 and 1.0"),
    ("clip high out of range", "cispo", [rl_datum()], {"clip_high_threshold": 11.0}, "clip_high_threshold'] = 11.0 is out of range for cispo; it must be between 1.0 and 10.0"),
    ("negative beta", "dro", [rl_datum()], {"beta": -0.1}, "'beta'] = -0.1 is out of range for dro; it must be at least 0.0"),
    ("nan advantages", "ppo", [rl_datum(advantages=[1.0, float("nan"), 1.0])], None, "datum 0: loss_fn_inputs['advantages'] contains NaN"),
    ("weights on dro", "dro", [rl_datum(weights=[1.0] * 3)], None, "datum 0: loss_fn_inputs has ['weights'], which loss 'dro' does not read"),
    ("mis-shaped weights", "ppo", [rl_datum(), rl_datum(weights=[1.0, 0.0])], None, "datum 1: weights has shape [2]"),
    ("nan weights", "cispo", [rl_datum(weights=[1.0, float("nan"), 1.0])], None, "datum 0: loss_fn_inputs['weights'] contains NaN"),
    ("target out of vocabulary", "cross_entropy", [datum([1, 2, 3]), datum([1, 2, 10**7])], None, "datum 1: target_tokens has token id 10000000"),
    ("top-K weights 1-D", "cross_entropy", [rl_datum(target_tokens=topk_datum(TOPK_IDS, TOPK_W).loss_fn_inputs["target_tokens"], weights=[1.0] * 3, logprobs=None, advantages=None)], None, "datum 0: target_tokens has shape [3, 2] and weights has shape [3]; target_tokens and weights must have the same shape"),
    ("top-K widths differ", "cross_entropy", [topk_datum(TOPK_IDS, [[0.5, 0.5, 0.0]] * 3)], None, "datum 0: target_tokens has shape [3, 2] and weights has shape [3, 3]"),
    ("top-K rows short", "cross_entropy", [topk_datum([[2, 3]] * 2, [[0.5, 0.5]] * 2)], None, "datum 0: target_tokens has shape [2, 2] but model_input has 3 tokens; a 2-D target_tokens must be [3, K]"),
    ("top-K id out of vocabulary", "cross_entropy", [topk_datum([[2, 3], [4, 5], [6, 10**7]], TOPK_W)], None, "datum 0: target_tokens has token id 10000000 at target_tokens[2, 1], outside the vocabulary"),
    ("top-K nan weight", "cross_entropy", [topk_datum(TOPK_IDS, [[0.5, 0.5], [0.5, float("nan")], [1.0, 0.0]])], None, "datum 0: loss_fn_inputs['weights'] contains NaN"),
    ("top-K K of another datum", "cross_entropy", [topk_datum(TOPK_IDS, TOPK_W), topk_datum([[2, 3, 4]] * 3, [[0.5, 0.25, 0.25]] * 3)], None, "datum 1: target_tokens is [N, 3] but datum 0's is [N, 2]"),
    ("top-K too wide", "cross_entropy", [topk_datum([[2] * 65] * 3, [[0.0] * 65] * 3)], None, "at most 64 values per token"),
    ("top-K on ppo", "ppo", [rl_datum(target_tokens=topk_datum(TOPK_IDS, TOPK_W).loss_fn_inputs["target_tokens"])], None, "datum 0: target_tokens has shape [3, 2]; loss 'ppo' takes 1-D inputs"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("loss_fn", "data", "config", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rejection_is_400_and_appends_nothing(
    model, engine, loss_fn, data, config, message
) -> None:
    client, model_id = model
    before = _event_count(engine, model_id)
    response = client.forward_backward(model_id, 1, data, loss_fn=loss_fn, config=config)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert _event_count(engine, model_id) == before


def test_every_loss_is_accepted_and_reports_loss_sum(model) -> None:
    """Every loss, then the RL losses that take the optional per-token `weights` mask with it:
    all-zero weights leave nothing of the loss."""
    client, model_id = model
    seq = 1  # the rejected requests above used seq 1 and appended nothing
    calls: list[tuple[str, list[types.Datum], float | None]] = [
        (loss_fn, [datum([1, 2, 3, 4, 5])] if loss_fn == "cross_entropy" else [rl_datum(4)], None)
        for loss_fn in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
    ]
    for loss_fn in ("importance_sampling", "ppo", "cispo"):
        calls.append((loss_fn, [rl_datum(4, weights=[0.0, 1.0, 1.0, 0.5])], None))
        calls.append((loss_fn, [rl_datum(4, weights=[0.0] * 4)], 0.0))
    for loss_fn, data, expected_sum in calls:
        response = client.forward_backward(model_id, seq, data, loss_fn=loss_fn)
        assert response.status_code == 200, response.text
        out = client.result(response.json()["request_id"])
        assert "loss:sum" in out.metrics
        if expected_sum is not None:
            assert out.metrics["loss:sum"] == expected_sum
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 4
        seq += 1
