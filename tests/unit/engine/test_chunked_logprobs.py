"""Chunked logprobs and checkpointed layers give the plain forward's results, on every architecture.

The plain path is the model's own forward with full logits (what `batch_loss` ran before
chunking); each tiny random model of tests/architectures.py runs with a LoRA adapter whose B is
nonzero (attention and unembedding, so the output layer's delta is chunked too), on a padded
batch longer than the sliding windows. Float32 on the CPU: equal within 1e-5.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import DATA, new_adapter, randomise_b
from transformers import LlamaForCausalLM, PreTrainedModel

from tests.architectures import ARCHITECTURES, build
from treadle.engine import Engine
from treadle.engine.lora.adapters import LoraHost, LoraSpec, LoraWeights
from treadle.engine.losses import functions as losses_module
from treadle.engine.losses.activation_cost import estimated_cost, measured_cost, token_cost
from treadle.engine.losses.chunked_logprobs import (
    CHECKPOINT_ABOVE_FRACTION,
    checkpointed_layers,
    output_head,
    target_logprobs,
    wants_checkpointing,
)
from treadle.engine.losses.functions import (
    MICROBATCH_TOKENS,
    EngineDatum,
    batch_loss,
    get_loss,
    microbatches,
    validate_data,
)
from treadle.engine.losses.passes import cpu_pass_tokens

VOCAB = 256
LENGTHS = (24, 17)  # longer than the sliding windows (16); 41 real positions, 48 padded
CHUNK_ROWS = (1, 7, 41, 1000)  # 7 divides neither T nor the 41 positions; 1000: one chunk
TOL = 1e-5  # relative and absolute
LOSS = get_loss("cross_entropy")


@pytest.fixture(autouse=True)
def always_chunked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare the chunked path with the plain one: no pass is small enough to be
    computed whole (`FULL_LOGITS_AT_MOST`), except in the test of that rule itself."""
    if "whole" not in request.node.name:
        monkeypatch.setattr(losses_module, "FULL_LOGITS_AT_MOST", 0)


def adapted(name: str) -> tuple[PreTrainedModel, LoraHost, LoraWeights]:
    """The tiny `name` model, frozen, with an active-able adapter whose B is random."""
    model = build(name, VOCAB)
    model.requires_grad_(False)
    host = LoraHost(model)
    weights = host.new_weights(LoraSpec(rank=4, alpha=8, train_mlp=False), torch.device("cpu"))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for b in weights.B.values():
            b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    assert "lm_head" in weights.B, "the output layer's LoRA delta must be exercised"
    return model, host, weights


def batch() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    data = [
        EngineDatum(
            tokens=tuple(int(t) for t in rng.integers(0, VOCAB, n)),
            loss_fn_inputs={
                "target_tokens": rng.integers(0, VOCAB, n),
                "weights": rng.uniform(0.5, 1.5, n).astype(np.float32),
            },
        )
        for n in LENGTHS
    ]
    return validate_data(data, LOSS, vocab_size=VOCAB, max_context_length=512)


def tensors(arrays: list[dict[str, np.ndarray]]) -> tuple[torch.Tensor, ...]:
    width = max(LENGTHS)
    tokens_B_T = torch.zeros(len(arrays), width, dtype=torch.long)
    targets_B_T = torch.zeros(len(arrays), width, dtype=torch.long)
    for row, a in enumerate(arrays):
        tokens_B_T[row, : len(a["tokens"])] = torch.from_numpy(a["tokens"])
        targets_B_T[row, : len(a["tokens"])] = torch.from_numpy(a["target_tokens"])
    mask_B_T = torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]
    return tokens_B_T, mask_B_T, targets_B_T


def lora_grads(
    model: PreTrainedModel, host: LoraHost, weights: LoraWeights, **options: object
) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """The adapter's grads of one `batch_loss` (with `options`) and its per-datum logprobs."""
    for p in weights.parameters():
        p.grad = None
    with host.use(weights):  # the backward recomputes with the adapter active, as the engine's
        outputs, total = batch_loss(model, batch(), LOSS, {}, **options)  # type: ignore[arg-type]
        total.backward()
    grads = {name: t.grad.numpy().copy() for name, t in weights.tensors() if t.grad is not None}
    assert len(grads) == len(weights.tensors())
    return grads, [o["logprobs"] for o in outputs]


@contextmanager
def saved_tensors() -> Iterator[list[torch.Tensor]]:
    """The tensors autograd keeps for the backward outside any checkpoint (a checkpoint's own
    hooks take the ones inside it)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architecture_has_a_known_output_layer(name: str) -> None:
    """So none of the admitted architectures silently falls back to full logits."""
    assert output_head(build(name, VOCAB)) is not None


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_chunked_logprobs_equal_the_full_logits_ones(name: str) -> None:
    model, host, weights = adapted(name)
    tokens_B_T, mask_B_T, targets_B_T = tensors(batch())
    with torch.no_grad(), host.use(weights):
        plain_B_T = target_logprobs(model, tokens_B_T, mask_B_T, targets_B_T, logits_per_chunk=None)
        for rows in CHUNK_ROWS:
            chunked_B_T = target_logprobs(
                model, tokens_B_T, mask_B_T, targets_B_T, logits_per_chunk=rows * VOCAB
            )
            assert chunked_B_T.dtype == torch.float32
            torch.testing.assert_close(
                chunked_B_T[mask_B_T], plain_B_T[mask_B_T], rtol=TOL, atol=TOL
            )


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_chunked_and_checkpointed_grads_equal_the_plain_ones(name: str) -> None:
    model, host, weights = adapted(name)
    plain, plain_lp = lora_grads(
        model, host, weights, logits_per_chunk=None, checkpoint_layers=False
    )
    assert max(float(np.abs(g).max()) for g in plain.values()) > 1e-3
    for rows in (1, 7):
        both, both_lp = lora_grads(
            model, host, weights, logits_per_chunk=rows * VOCAB, checkpoint_layers=True
        )
        for grad_name, grad in plain.items():
            np.testing.assert_allclose(both[grad_name], grad, rtol=TOL, atol=TOL, err_msg=grad_name)
        for x, y in zip(both_lp, plain_lp, strict=True):
            np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL)


def test_chunking_keeps_no_logits_for_the_backward() -> None:
    """The plain path keeps [B, T, V] logits until the backward; the chunked one keeps none (the
    backward recomputes each chunk's), only weights have a vocabulary-sized dimension."""
    model, host, weights = adapted("qwen3")
    tokens_B_T, mask_B_T, targets_B_T = tensors(batch())
    weight_storages = {
        p.untyped_storage().data_ptr() for p in [*model.parameters(), *weights.parameters()]
    }

    def kept_logits(chunk: int | None) -> list[tuple[int, ...]]:
        with host.use(weights), saved_tensors() as saved:
            target_logprobs(model, tokens_B_T, mask_B_T, targets_B_T, logits_per_chunk=chunk)
        return [
            tuple(t.shape)
            for t in saved
            if VOCAB in t.shape and t.untyped_storage().data_ptr() not in weight_storages
        ]

    assert (2, max(LENGTHS), VOCAB) in kept_logits(None)
    assert kept_logits(7 * VOCAB) == []


def test_checkpointed_layers_keep_fewer_activations_and_are_undone() -> None:
    model, host, weights = adapted("llama3")
    tokens_B_T, mask_B_T, targets_B_T = tensors(batch())

    def kept_bytes(checkpointed: bool) -> int:
        with host.use(weights), saved_tensors() as saved:
            with checkpointed_layers(model) if checkpointed else torch.enable_grad():
                target_logprobs(model, tokens_B_T, mask_B_T, targets_B_T, logits_per_chunk=VOCAB)
            return sum(t.numel() * t.element_size() for t in saved if t.is_floating_point())

    plain, checkpointed = kept_bytes(False), kept_bytes(True)
    assert checkpointed < plain / 3
    assert all("forward" not in vars(layer) for layer in model.get_decoder().layers)


def test_an_unknown_output_layer_runs_the_full_logits() -> None:
    class Custom(LlamaForCausalLM):  # a subclass may change what its forward does
        pass

    model = build("llama3", VOCAB)
    custom = Custom(model.config)
    custom.load_state_dict(model.state_dict())
    assert output_head(custom) is None
    tokens_B_T, mask_B_T, targets_B_T = tensors(batch())
    with torch.no_grad():
        lp_B_T = target_logprobs(custom, tokens_B_T, mask_B_T, targets_B_T, logits_per_chunk=VOCAB)
        expected_B_T = target_logprobs(
            model, tokens_B_T, mask_B_T, targets_B_T, logits_per_chunk=None
        )
    torch.testing.assert_close(lp_B_T, expected_B_T, rtol=0, atol=0)


def test_checkpointing_by_default_only_where_the_measured_activations_pass_the_budget() -> None:
    import psutil

    model = build("llama3", VOCAB).requires_grad_(False)  # frozen, as the engine loads it
    LoraHost(model)
    budget = CHECKPOINT_ABOVE_FRACTION * psutil.virtual_memory().total  # the CPU: the host's
    cost = token_cost(model)
    assert cost.measured and cost == measured_cost(model)
    # hidden 32, 2 layers, float32, the adapter's inputs included: 4,140 bytes a token, where
    # the estimate the threshold used before says 7,168
    assert cost.layers == 4140 and estimated_cost(model).layers == 7168
    assert not wants_checkpointing(model, MICROBATCH_TOKENS)
    assert not wants_checkpointing(model, int(budget // cost.layers) - 1)
    assert wants_checkpointing(model, int(budget // cost.layers) + 1)
    # the threshold follows the cost: on a device of 100 passes of 1,000 tokens at that cost
    device = int(1000 * cost.layers / CHECKPOINT_ABOVE_FRACTION)
    assert not wants_checkpointing(model, 1000, device)
    assert wants_checkpointing(model, 1001, device)


def test_microbatches_are_bounded_by_the_pass_budget() -> None:
    arrays = [{"tokens": np.zeros(n, np.int64)} for n in (8192, 8192, 100, 16384)]
    groups = microbatches(arrays, MICROBATCH_TOKENS)
    assert [[len(a["tokens"]) for a in g] for g in groups] == [[8192, 8192], [100], [16384]]
    # the CPU's budget for a 151,936-token vocabulary is 220 tokens: each runs alone
    assert len(microbatches(arrays, cpu_pass_tokens(151_936))) == 4


def test_the_engine_checkpointing_or_not_accumulates_the_same_grads(cache_dir: Path) -> None:
    grads, losses = [], []
    for checkpointing in (False, True):
        engine = Engine(cache_dir=cache_dir, device="cpu", activation_checkpointing=checkpointing)
        adapter = new_adapter(engine)
        randomise_b(engine, adapter, seed=4)
        result = engine.forward_backward(adapter, DATA, "cross_entropy")
        losses.append(result.metrics["loss:sum"])
        grads.append(engine.adapter_grads(adapter))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for name, grad in grads[0].items():
        np.testing.assert_allclose(grads[1][name], grad, rtol=TOL, atol=TOL, err_msg=name)


def test_a_pass_whose_logits_are_small_is_computed_whole() -> None:
    model, host, weights = adapted("qwen3")
    default, default_lp = lora_grads(model, host, weights)
    whole, whole_lp = lora_grads(model, host, weights, logits_per_chunk=None)
    for a, b in zip(default_lp, whole_lp, strict=True):  # the same computation, bit for bit
        np.testing.assert_array_equal(a, b)
    for name, grad in whole.items():
        np.testing.assert_array_equal(default[name], grad)
