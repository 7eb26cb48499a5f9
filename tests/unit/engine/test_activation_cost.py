"""The activation cost per token a training pass keeps for its backward (`activation_cost`),
which the checkpointing threshold and the CUDA pass budget read: measured on the model's own
decoder with its LoRA host's adapter on, it is what a longer pass saves per token; cached per
model; a model on the meta device (admission's) gets the estimate."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.architectures import build
from treadle.engine.lora.adapters import LoraHost, LoraSpec, compute_dtype
from treadle.engine.losses.activation_cost import (
    PROBE_TOKENS,
    estimated_cost,
    measured_cost,
    saved_bytes,
    token_cost,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cost_is_what_a_longer_pass_of_the_adapter_saves_per_token(dtype: torch.dtype) -> None:
    model = build("llama3").to(dtype).requires_grad_(False)
    host = LoraHost(model)
    # rank 1 on every attention and MLP linear, as the probe's (a higher rank keeps rank-sized
    # products more, a few bytes a token next to the hidden-sized ones)
    spec = LoraSpec(rank=1, alpha=2.0, seed=5, train_unembed=False)
    adapter = host.new_weights(spec, torch.device("cpu")).in_dtype(compute_dtype(dtype))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {p.untyped_storage().data_ptr() for p in adapter.parameters()}

    def pass_of(tokens: int) -> int:
        ids_B_T = torch.tensor([[(7 * i + 3) % 256 for i in range(tokens)]])

        def run() -> torch.Tensor:
            with torch.no_grad():
                embeds_B_T_H = model.get_input_embeddings()(ids_B_T)
            embeds_B_T_H.requires_grad_(True)
            with host.use(adapter):
                return model.get_decoder()(inputs_embeds=embeds_B_T_H).last_hidden_state

        return saved_bytes(run, weights)

    cost = token_cost(model)
    assert cost.measured
    assert pass_of(10 * PROBE_TOKENS) - pass_of(5 * PROBE_TOKENS) == 5 * PROBE_TOKENS * cost.layers
    assert cost.layer == cost.layers // 2  # two layers
    assert token_cost(model) is cost  # measured once per model


def test_the_adapter_in_bfloat16_keeps_half_what_it_keeps_in_float32() -> None:
    added = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build("llama3").to(dtype).requires_grad_(False)
        bare = measured_cost(model).layers  # the base model's own (its norms keep float32)
        LoraHost(model)
        added[dtype] = token_cost(model).layers - bare
    # what the adapter adds (its linears' inputs and rank-sized products) in its compute dtype
    assert added[torch.bfloat16] > 0
    assert 2 * added[torch.bfloat16] == added[torch.float32]


def test_a_model_on_the_meta_device_gets_the_estimate() -> None:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    cost = token_cost(model)
    assert not cost.measured and cost == estimated_cost(model)
    # per layer 20 hidden-sized bf16 values and q, k, v, o, gate, up (16 each), down (32) in
    # bf16, the adapter's compute dtype
    assert cost.layers == 3 * (20 * 16 * 2 + (6 * 16 + 32) * 2)
