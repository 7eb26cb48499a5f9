"""Target-token logprobs without a full [tokens, vocabulary] logits tensor, and checkpointed layers.

Owns `target_logprobs`: the backbone's final hidden states once, then the output layer and
log-softmax a chunk of positions at a time under a non-reentrant `torch.utils.checkpoint`, so
the forward and the backward each hold one chunk's logits (the backward recomputes them) instead
of float32 [T, V] (~20 GB at 32k tokens of a 151,936-token vocabulary). Only output layers whose
forward is known (`output_head`) are chunked; any other model runs its own forward, full logits.
Also owns `checkpointed_layers` (each decoder layer recomputed in the backward instead of keeping
its activations) and `wants_checkpointing`, the default for when that pays (from the cost per
token measured on the model, `activation_cost`). Recomputing reads the
LoRA host's active adapter again: run the backward with the forward's adapter still active.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import (
    Gemma3ForCausalLM,
    GlmForCausalLM,
    GptOssForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Olmo2ForCausalLM,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen3VLForConditionalGeneration,
    SmolLM3ForCausalLM,
    StableLmForCausalLM,
)

from treadle.engine.losses.activation_cost import token_cost
from treadle.engine.memory.capacity import device_memory

__all__ = [
    "CHECKPOINT_ABOVE_FRACTION",
    "FULL_LOGITS_AT_MOST",
    "checkpointed_layers",
    "output_head",
    "target_logprobs",
    "wants_checkpointing",
]

Tensor = torch.Tensor
Head = Callable[[Tensor], Tensor]  # final hidden states [N, H] -> logits [N, V], model dtype

# CausalLMs whose forward (transformers 5.25) is `lm_head(backbone(...).last_hidden_state)` and
# nothing more; Gemma 3 then soft-caps. Matched by exact type: a subclass may change its forward.
# Any other architecture the registry admits by its structure runs its own forward, full logits.
# Router aux losses (Qwen3-MoE, gpt-oss) come only with output_router_logits, which the loss never
# asked for. tests/unit/engine/test_chunked_logprobs.py fails when a new transformers changes one.
_PLAIN_HEADS = (
    LlamaForCausalLM,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    GptOssForCausalLM,
    Olmo2ForCausalLM,
    StableLmForCausalLM,
    SmolLM3ForCausalLM,
    GlmForCausalLM,
    Qwen3VLForConditionalGeneration,  # its forward: lm_head(language model(inputs + images))
)

# Checkpointing costs one more forward of the layers, about a third more compute per training
# pass; pay it only where the activations it saves, at the model's cost per token as measured on
# the model itself (`activation_cost.token_cost`), would take a quarter of the device's memory
# (the GPU's, or the host's on the CPU).
CHECKPOINT_ABOVE_FRACTION = 0.25
# Logits (positions x vocabulary) a pass computes whole, the fastest way: past this, in chunks
# recomputed in the backward (one more pass of the output layer), so the memory stays one
# chunk's. 2**27 float32 values are 512 MiB: a 2,048-token pass of a 49,152-token vocabulary is
# whole, 8,192 tokens of a 151,936-token one are chunked.
FULL_LOGITS_AT_MOST = 2**27


def output_head(model: PreTrainedModel) -> Head | None:
    """What `model`'s forward does after its backbone, as a function of the final hidden states
    (`model.lm_head` called as a module, so an adapter's delta on it applies), or None when
    this architecture's forward is not known to be only that."""
    lm_head = getattr(model, "lm_head", None)
    if not isinstance(lm_head, nn.Module):
        return None
    if type(model) in _PLAIN_HEADS:
        return lm_head
    if type(model) is Gemma3ForCausalLM:
        cap = model.config.final_logit_softcapping
        if cap is None:
            return lm_head

        def soft_capped(hidden_N_H: Tensor) -> Tensor:
            # The same operations in the same order as Gemma3ForCausalLM.forward.
            logits_N_V = lm_head(hidden_N_H) / cap
            return torch.tanh(logits_N_V) * cap

        return soft_capped
    return None


def target_logprobs(
    model: PreTrainedModel,
    tokens_B_T: Tensor,
    mask_B_T: Tensor,
    targets_B_T: Tensor,
    *,
    logits_per_chunk: int | None,
    plan_tokens: int | None = None,
    images: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """float32 log softmax(logits)[target] at every position of the right-padded batch
    (padding's computed too, and meaningless): [B, T] for `targets_B_T` [B, T], or [B, T, K]
    for top-K targets [B, T, K] (K logprobs a position, gathered from each chunk's logits, so
    what outlives a chunk is tokens x K, never tokens x vocabulary). With `logits_per_chunk`
    and an output layer `output_head` knows, the logits are computed for at most that many
    elements (positions x vocabulary) at a time and recomputed in the backward; otherwise
    (None, or an unknown head) from the model's full logits. With `plan_tokens`, the output
    layer runs as many chunks as a pass of that many positions would, the extra ones empty: a
    sharded group's ranks, whose output layer is a collective (`distributed.vocabulary`), call
    it as often as each other. `images`: a vision-language model's image inputs for the rows
    (`models.vision.pass_inputs`; none: the rows are text)."""
    head = output_head(model) if logits_per_chunk is not None else None
    extra = dict(images or {})
    if head is None or logits_per_chunk is None:
        logits_B_T_V = model(
            input_ids=tokens_B_T, attention_mask=mask_B_T.long(), use_cache=False, **extra
        ).logits.float()
        return _picked(logits_B_T_V, targets_B_T)
    # with images, the multimodal model below the head (it merges the image features into the
    # language model's inputs); else the decoder alone
    body = model.model if extra else model.get_decoder()
    hidden_B_T_H = body(
        input_ids=tokens_B_T, attention_mask=mask_B_T.long(), use_cache=False, **extra
    ).last_hidden_state
    # Padding's logits too, as the full forward computes them: skipping them changed the float
    # rounding of the grads enough to break tests/unit/engine/test_engine.py's 1e-6 comparisons.
    hidden_N_H, targets_N = hidden_B_T_H.flatten(0, 1), targets_B_T.flatten(0, 1)  # [N] or [N, K]
    rows = max(1, logits_per_chunk // model.config.vocab_size)
    pieces = []
    # `split`, not slicing: its backward concatenates the chunks' grads once, where each slice's
    # would write a zero-filled [N, H] tensor.
    chunks = list(zip(hidden_N_H.split(rows), targets_N.split(rows), strict=True))
    if plan_tokens is not None:  # empty views, so that the backward reaches them too
        chunks += [(hidden_N_H[:0], targets_N[:0])] * (-(-plan_tokens // rows) - len(chunks))
    for hidden_C_H, targets_C in chunks:
        if torch.is_grad_enabled():
            lp_C = checkpoint(_chunk_logprobs, head, hidden_C_H, targets_C, use_reentrant=False)
        else:
            lp_C = _chunk_logprobs(head, hidden_C_H, targets_C)
        pieces.append(lp_C)
    return torch.cat(pieces).view(targets_B_T.shape)


def _chunk_logprobs(head: Head, hidden_C_H: Tensor, targets_C: Tensor) -> Tensor:
    return _picked(head(hidden_C_H).float(), targets_C)


def _picked(logits_V: Tensor, targets: Tensor) -> Tensor:
    """log softmax(`logits_V`) at `targets`: one id a position (targets' shape is the logits'
    without the vocabulary) or K (targets [..., K])."""
    if targets.dim() == logits_V.dim() - 1:  # one target a position
        picked = logits_V.gather(-1, targets[..., None])[..., 0]
        return picked - torch.logsumexp(logits_V, dim=-1)
    picked_K = logits_V.gather(-1, targets)
    return picked_K - torch.logsumexp(logits_V, dim=-1, keepdim=True)


def wants_checkpointing(
    model: PreTrainedModel, tokens: int, device_bytes: int | None = None
) -> bool:
    """Whether checkpointing the decoder layers of a training pass over `tokens` padded tokens
    saves enough memory to be worth a third more compute (see CHECKPOINT_ABOVE_FRACTION) on a
    device of `device_bytes` (None: the model's own device's memory): whether the pass's
    activations, `tokens` x the bytes a token keeps in the decoder layers (measured once per
    model: `activation_cost.token_cost`), would take more than that fraction of it."""
    kept = token_cost(model).layers
    if device_bytes is None:
        device_bytes = device_memory(next(model.parameters()).device)
    return tokens * kept > CHECKPOINT_ABOVE_FRACTION * device_bytes


@contextlib.contextmanager
def checkpointed_layers(model: PreTrainedModel) -> Iterator[None]:
    """Within the block, each decoder layer (the backbone's `layers`) runs under a non-reentrant
    checkpoint while grads are enabled: the backward recomputes the layer from its input instead
    of keeping its activations. Grads, frozen base weights and the adapter's included, are those
    of the plain run. A model without a `layers` list runs as is.

    Our own wrapper rather than transformers' `gradient_checkpointing_enable`, which checkpoints
    only in training mode (the engine keeps models in eval mode) and stays on for every later
    call, sampling's included."""
    layers = getattr(model.get_decoder(), "layers", None)
    wrapped = list(layers) if isinstance(layers, nn.ModuleList) else []
    for layer in wrapped:
        # An instance attribute shadows the class's forward; nn.Module.__call__ looks it up.
        layer.forward = functools.partial(_checkpointed, layer.forward)
    try:
        yield
    finally:
        for layer in wrapped:
            del layer.forward


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
