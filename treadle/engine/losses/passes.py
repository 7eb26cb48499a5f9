"""How many padded tokens one pass of a forward_backward may hold: the engine's token budget.

A request's data are cut into passes (`losses.microbatches`) of at most this many padded tokens
(rows x longest); a datum longer than that runs alone. The logits are bounded apart from it (the
output layer runs in chunks past `chunked_logprobs.FULL_LOGITS_AT_MOST`), so the budget counts
only what grows with a pass's tokens: what the decoder layers and the LoRA keep for the backward,
measured on the model (`activation_cost`).

- An operator's setting (`TREADLE_MICROBATCH_TOKENS`) wins everywhere.
- On CUDA: PASS_MEMORY_FRACTION of the device's memory left after the base models' weights on it,
  less LOGITS_RESERVE, divided by `token_bytes` (documented there); by default no more than a
  pass the engine runs without checkpointing may hold (`cuda_pass_tokens`).
- On the CPU: the rule the engine always ran (at most MICROBATCH_TOKENS tokens and
  MICROBATCH_LOGITS logits a pass), measured no slower than larger passes (docs/benchmarks.md).

A datum's results depend on how the data are grouped, up to float rounding, so the budget a
forward_backward ran with is recorded in its result and a replay runs with that one
(docs/recovery.md). Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PreTrainedModel

from treadle.engine.losses.activation_cost import token_cost
from treadle.engine.losses.chunked_logprobs import (
    CHECKPOINT_ABOVE_FRACTION,
    FULL_LOGITS_AT_MOST,
    wants_checkpointing,
)
from treadle.engine.losses.functions import MICROBATCH_LOGITS, MICROBATCH_TOKENS
from treadle.engine.memory.capacity import device_memory

__all__ = [
    "LOGITS_RESERVE",
    "PASS_MEMORY_FRACTION",
    "cpu_pass_tokens",
    "cuda_pass_tokens",
    "pass_tokens",
    "resident_bytes",
    "token_bytes",
]

# The share of the device's memory after the weights that one pass's activations may take: the
# rest is for the resident adapters with their grads and Adam state, sampling snapshots and the
# sampler's KV cache (16 adapters of an 8B model at rank 32 with Adam state are about 22 GB).
PASS_MEMORY_FRACTION = 0.5
# What the output layer holds at most, whatever the pass's size: about three float32 tensors of
# FULL_LOGITS_AT_MOST logits (the logits, their log-softmax, its gradient), 1.5 GiB.
LOGITS_RESERVE = 3 * 4 * FULL_LOGITS_AT_MOST


def cpu_pass_tokens(vocab_size: int) -> int:
    """The CPU's default: at most MICROBATCH_TOKENS padded tokens and MICROBATCH_LOGITS logits
    a pass (2^25 / 49,152 = 682 tokens of SmolLM2), the rule the engine ran before passes were
    sized by tokens, so the CPU's results and the logs it wrote replay unchanged."""
    return max(1, min(MICROBATCH_TOKENS, MICROBATCH_LOGITS // vocab_size))


def token_bytes(model: PreTrainedModel, *, checkpointed: bool) -> int:
    """Bytes a training pass keeps per padded token until its backward:

        plain:        C
        checkpointed: L x H x e + C / L

    with C the decoder layers' cost per token (`activation_cost.token_cost`: measured on the
    model, the adapter's saved inputs included; estimated for a model that cannot be probed
    here, as admission's meta-device models), L decoder layers of hidden size H, weights of e
    bytes. Checkpointed, each layer keeps only its input and one layer at a time is
    recomputed."""
    cost = token_cost(model)
    if not checkpointed:
        return cost.layers
    config = model.config.get_text_config()
    element = next(model.parameters()).element_size()
    return config.num_hidden_layers * config.hidden_size * element + cost.layer


def resident_bytes(models: Iterable[nn.Module], device: torch.device) -> int:
    """Bytes of the models' weights held on `device` (a sharded model's local shards only)."""
    total = 0
    for model in models:
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.device == device:
                total += local.numel() * local.element_size()
    return total


def cuda_pass_tokens(
    model: PreTrainedModel, device_bytes: int, weights_bytes: int, checkpointing: bool | None
) -> int:
    """The budget on an accelerator of `device_bytes` with `weights_bytes` of base models on
    it (see the module's docstring):

        (PASS_MEMORY_FRACTION x (device_bytes - weights_bytes) - LOGITS_RESERVE) / token_bytes

    checkpointed (`checkpointing` True), or plain (False). None, the engine's default: plain,
    and at most as many tokens as a pass the engine does not checkpoint may hold
    (CHECKPOINT_ABOVE_FRACTION of the device: `wants_checkpointing`), so that passes of the
    budget run without recomputing their layers (about a third more compute each); a datum
    longer than the budget runs alone, checkpointed where its size says so."""
    free = PASS_MEMORY_FRACTION * (device_bytes - weights_bytes) - LOGITS_RESERVE
    if checkpointing:
        return max(1, int(free // token_bytes(model, checkpointed=True)))
    per_token = token_bytes(model, checkpointed=False)
    if checkpointing is None:
        free = min(free, CHECKPOINT_ABOVE_FRACTION * device_bytes)
    tokens = max(1, int(free // per_token))
    while checkpointing is None and tokens > 1 and wants_checkpointing(model, tokens, device_bytes):
        tokens -= 1  # the threshold's own rounding
    return tokens


def pass_tokens(
    model: PreTrainedModel,
    device: torch.device,
    *,
    configured: int | None,
    weights_bytes: int,
    checkpointing: bool | None,
) -> int:
    """The padded tokens a pass on `device` may hold: `configured` if set, else the device's
    rule (`cuda_pass_tokens`, `cpu_pass_tokens`)."""
    if configured:
        return configured
    if device.type == "cuda":
        return cuda_pass_tokens(model, device_memory(device), weights_bytes, checkpointing)
    return cpu_pass_tokens(model.config.vocab_size)
