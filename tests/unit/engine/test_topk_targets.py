"""cross_entropy's top-K targets ([N, K] target_tokens and weights) against plain PyTorch.

loss = -sum_t sum_k w_tk * log p(x_tk) (Tinker's "Top-K distillation"), logprobs and
elementwise losses [N, K] per datum. The reference is the bare model's full logits, log_softmax
and gather, written out here; the engine must match it to 1e-5 in the loss, the outputs and the
LoRA grads, whole (a small pass) and in chunks of the vocabulary's logits (the chunked path
keeps no [tokens, vocabulary] tensor for the backward, only [tokens, K]).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import HandLora, new_adapter, randomise_b, reference_logprobs

from tests.architectures import build
from treadle.engine import Engine, EngineDatum, LoraSpec
from treadle.engine.lora.adapters import LoraHost
from treadle.engine.losses import functions as losses_module
from treadle.engine.losses.chunked_logprobs import target_logprobs
from treadle.engine.losses.functions import batch_loss, get_loss, validate_data
from treadle.platform.errors import ValidationError

TOL = {"rtol": 1e-5, "atol": 1e-5}
SMALL_LORA = LoraSpec(rank=2, alpha=4.0, seed=11)
TOKENS = (11, 2222, 333, 5)
# K = 3 targets a position: a repeated id, the position's own next token, and padding columns
# (id 0, weight 0) as tinker-cookbook's sdft sends them
TARGETS_T_K = np.asarray([[2222, 7, 7], [333, 40000, 0], [5, 12, 9], [0, 0, 0]], np.int64)
WEIGHTS_T_K = np.asarray(
    [[0.5, 0.3, 0.2], [1.0, -0.25, 0.0], [0.1, 0.6, 0.3], [0.0, 0.0, 0.0]], np.float32
)
CE = get_loss("cross_entropy")


def topk_datum(tokens=TOKENS, targets=TARGETS_T_K, weights=WEIGHTS_T_K) -> EngineDatum:  # type: ignore[no-untyped-def]
    return EngineDatum(tuple(tokens), {"target_tokens": targets, "weights": weights})


def test_topk_cross_entropy_matches_plain_pytorch(engine: Engine, cache_dir: Path) -> None:
    adapter = new_adapter(engine, SMALL_LORA)
    randomise_b(engine, adapter, seed=5)
    hand = HandLora(engine.adapter_weights(adapter), SMALL_LORA.alpha / SMALL_LORA.rank)
    # log p(x_tk): column k through the reference, one gather of the full log_softmax each
    lp_T_K = torch.stack(
        [reference_logprobs(cache_dir, TOKENS, TARGETS_T_K[:, k], hand) for k in range(3)], -1
    )
    expected_T_K = -torch.from_numpy(WEIGHTS_T_K) * lp_T_K

    out = engine.forward_backward(adapter, [topk_datum()], "cross_entropy")

    assert out.outputs[0]["logprobs"].shape == (4, 3)
    assert out.outputs[0]["elementwise_loss"].shape == (4, 3)
    np.testing.assert_allclose(out.outputs[0]["logprobs"], lp_T_K.detach().numpy(), **TOL)
    np.testing.assert_allclose(out.outputs[0]["elementwise_loss"], expected_T_K.detach(), **TOL)
    assert out.metrics["loss:sum"] == pytest.approx(float(expected_T_K.detach().sum()), rel=1e-5)
    assert out.train_tokens == len(TOKENS)  # N tokens, not N x K
    grads, expected = engine.adapter_grads(adapter), hand.grads(expected_T_K.sum())
    scale = max(1.0, max(float(np.abs(g).max()) for g in expected.values()))
    for name, grad in expected.items():
        np.testing.assert_allclose(grads[name], grad, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def test_one_column_equals_the_one_dimensional_targets(engine: Engine) -> None:
    adapter = new_adapter(engine, SMALL_LORA)
    randomise_b(engine, adapter, seed=6)
    flat = topk_datum(targets=TARGETS_T_K[:, 0], weights=WEIGHTS_T_K[:, 0])
    column = topk_datum(targets=TARGETS_T_K[:, :1], weights=WEIGHTS_T_K[:, :1])
    one = engine.forward_backward(adapter, [flat], "cross_entropy", forward_only=True)
    two = engine.forward_backward(adapter, [column], "cross_entropy", forward_only=True)
    assert two.outputs[0]["logprobs"].shape == (4, 1)
    np.testing.assert_array_equal(two.outputs[0]["logprobs"][:, 0], one.outputs[0]["logprobs"])
    assert two.metrics["loss:sum"] == one.metrics["loss:sum"]


VOCAB = 256
LENGTHS = (24, 17)
K = 4


def _chunk_case() -> tuple[torch.nn.Module, LoraHost, object, list[EngineDatum]]:
    model = build("llama3", VOCAB).requires_grad_(False)
    host = LoraHost(model)
    weights = host.new_weights(LoraSpec(rank=4, alpha=8, train_mlp=False), torch.device("cpu"))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for b in weights.B.values():
            b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    rng = np.random.default_rng(3)
    data = [
        EngineDatum(
            tuple(int(t) for t in rng.integers(0, VOCAB, n)),
            {
                "target_tokens": rng.integers(0, VOCAB, (n, K)),
                "weights": rng.uniform(-0.5, 1.5, (n, K)).astype(np.float32),
            },
        )
        for n in LENGTHS
    ]
    return model, host, weights, data


@pytest.mark.parametrize("rows", [1, 7, 1000])
def test_chunked_topk_loss_and_grads_match_the_full_log_softmax(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(losses_module, "FULL_LOGITS_AT_MOST", 0)  # chunked however small
    model, host, weights, data = _chunk_case()
    arrays = validate_data(data, CE, vocab_size=VOCAB, max_context_length=512)
    params = weights.parameters()  # type: ignore[attr-defined]
    with host.use(weights):  # type: ignore[arg-type]
        outputs, total = batch_loss(model, arrays, CE, {}, logits_per_chunk=rows * VOCAB)
        got = torch.autograd.grad(total, params)
        # the reference: one datum at a time, the model's own full logits
        expected_loss = torch.zeros(())
        expected_lp = []
        for d in data:
            logits_T_V = model(torch.tensor([d.tokens])).logits[0].float()
            targets_T_K = torch.from_numpy(d.loss_fn_inputs["target_tokens"])
            lp_T_K = torch.log_softmax(logits_T_V, -1).gather(-1, targets_T_K)
            expected_lp.append(lp_T_K.detach().numpy())
            expected_loss = (
                expected_loss - (torch.from_numpy(d.loss_fn_inputs["weights"]) * lp_T_K).sum()
            )
        want = torch.autograd.grad(expected_loss, params)
    assert float(total.detach()) == pytest.approx(float(expected_loss.detach()), rel=1e-5)
    for out, lp in zip(outputs, expected_lp, strict=True):
        assert out["logprobs"].shape == lp.shape
        np.testing.assert_allclose(out["logprobs"], lp, **TOL)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), **TOL)


def test_chunked_topk_keeps_tokens_by_k_not_by_vocabulary() -> None:
    """What the chunked path keeps for the backward outside its checkpoints: nothing with a
    vocabulary-sized dimension but the weights; its logprobs are [B, T, K]."""
    model, host, weights, data = _chunk_case()
    arrays = validate_data(data, CE, vocab_size=VOCAB, max_context_length=512)
    width = max(LENGTHS)
    tokens_B_T = torch.zeros(2, width, dtype=torch.long)
    targets_B_T_K = torch.zeros(2, width, K, dtype=torch.long)
    for row, a in enumerate(arrays):
        tokens_B_T[row, : len(a["tokens"])] = torch.from_numpy(a["tokens"])
        targets_B_T_K[row, : len(a["tokens"])] = torch.from_numpy(a["target_tokens"])
    mask_B_T = torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]
    own = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *weights.parameters()]}  # type: ignore[attr-defined]
    saved: list[torch.Tensor] = []
    with (
        host.use(weights),
        torch.autograd.graph.saved_tensors_hooks(  # type: ignore[arg-type]
            lambda t: saved.append(t) or t, lambda t: t
        ),
    ):
        lp = target_logprobs(model, tokens_B_T, mask_B_T, targets_B_T_K, logits_per_chunk=7 * VOCAB)
    assert lp.shape == (2, width, K)
    assert saved, "the backward keeps something"
    kept = [
        t.shape for t in saved if VOCAB in t.shape and t.untyped_storage().data_ptr() not in own
    ]
    assert kept == []


def test_topk_targets_are_refused_for_other_losses_by_the_engine(engine: Engine) -> None:
    adapter = new_adapter(engine, SMALL_LORA)
    datum = EngineDatum(
        TOKENS,
        {
            "target_tokens": TARGETS_T_K,
            "logprobs": np.full(4, -1.0, np.float32),
            "advantages": np.ones(4, np.float32),
        },
    )
    with pytest.raises(ValidationError, match="loss 'ppo' takes 1-D inputs"):
        engine.forward_backward(adapter, [datum], "ppo")
