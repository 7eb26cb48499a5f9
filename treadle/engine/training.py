"""The training bodies: a forward_backward's passes and an optimizer step on one adapter.

A forward_backward runs in parts (`losses.microbatches`) of at most `pass_tokens` padded tokens
(the budget the caller settled on: `losses.passes`), split the same way whatever the
`Parallelism`: this process computes the passes it is given, whole units of the gradient's
canonical tree (`gradients`), keeping one running sum per unit, and `exchange` hands it every
part's outputs and loss, in order, and the request's gradient, added in that tree: the result is
the same bit for bit however the parts were spread, and a part's gradient is freed as soon as it
is added. The gradient reaches the adapter only when every part succeeded. On a bfloat16 (or
float16) model the passes run the adapter's copy in that dtype and the float32 sums go to its
float32 master weights' grads (`lora.adapters.TrainableLora`). The engine (`engine.Engine`) validates the
request and holds the adapter; this module only computes.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treadle.engine.dimuon import DimuonSpec
from treadle.engine.gradients import PairwiseSum, flatten, unflatten
from treadle.engine.lora.adapters import LoraHost, TrainableLora, compute_dtype
from treadle.engine.losses.chunked_logprobs import wants_checkpointing
from treadle.engine.losses.custom_graph import CustomLossGraph
from treadle.engine.losses.functions import (
    MICROBATCH_LOGITS,
    LossFn,
    batch_loss,
    microbatches,
    padded_tokens,
)
from treadle.engine.memory.heap import release_excess
from treadle.engine.models.threads import threads_for
from treadle.engine.optim import AdamSpec
from treadle.engine.protocol import Interrupt, Parallelism, Part
from treadle.platform.models.catalog import BaseModelInfo

__all__ = ["OPTIMIZER_WORK_PER_PARAMETER", "Base", "forward_backward", "optim_step"]

# An AdamW step's work per adapter parameter, in `threads`' multiply-adds (a dozen elementwise
# operations, each reading and writing the parameter's state).
OPTIMIZER_WORK_PER_PARAMETER = 16


@dataclass
class Base:
    """A loaded base model, shared by every adapter on it."""

    info: BaseModelInfo
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    host: LoraHost
    parameters: int  # multiply-adds a token costs in a forward pass, roughly (`threads`)


def forward_backward(
    base: Base,
    lora: TrainableLora,
    arrays: list[dict[str, np.ndarray]],
    loss: LossFn | CustomLossGraph,
    config: Mapping[str, float],
    *,
    parallel: Parallelism,
    device: torch.device,
    pass_tokens: int,
    checkpointing: bool | None,
    forward_only: bool,
    interrupt: Interrupt | None,
) -> tuple[list[dict[str, np.ndarray]], float]:
    """Each datum's outputs and the summed loss of validated `arrays` under `lora`; unless
    `forward_only`, the gradient is added to its accumulated grads. `interrupt` is called between
    passes: what it raises ends the call with no gradient added. Each pass holds at most
    `pass_tokens` padded tokens: the same number gives the same passes, and so the same bits."""
    vocab_size = base.model.config.vocab_size
    chunks = microbatches(arrays, pass_tokens)
    tokens_P = [padded_tokens(chunk) for chunk in chunks]
    units = parallel.units(len(chunks))
    unit_of = {p: u for u, unit in enumerate(units) for p in unit}
    passes = parallel.passes(tokens_P)
    tokens = sum(tokens_P[p] for p, _ in passes)
    checkpoint = checkpointing
    if checkpoint is None and parallel.sharded:
        # one choice for every pass of every rank: a checkpointed layer gathers its weights
        # again in the backward, and the ranks' gathers must pair up
        checkpoint = not forward_only and wants_checkpointing(base.model, max(tokens_P))
    # and one plan for the output layer's chunks, a collective too (`distributed.vocabulary`)
    plan = max(tokens_P, default=0) if parallel.sharded else None
    # The passes run the adapter in the model's activation dtype (its float32 masters
    # themselves on a float32 model); each part's grads are taken as float32 (`flatten`: exact
    # from bfloat16) and summed, and the sum reaches the float32 masters' grads.
    masters = lora.weights.parameters()
    weights = lora.weights.in_dtype(compute_dtype(base.model.dtype))
    params = weights.parameters()
    parts: dict[int, Part] = {}
    sums: dict[int, PairwiseSum] = {}  # per unit: its parts' gradients, never one per part
    with base.host.use(weights), torch.set_grad_enabled(not forward_only):
        for p, kept in passes:
            if interrupt is not None:
                interrupt()
            # per part, so a part runs on the same threads wherever it runs
            work = tokens_P[p] * base.parameters * (1 if forward_only else 3)
            with threads_for(work, device):
                part, grads = _part(
                    base, chunks[p], loss, config, params, forward_only, checkpoint, plan
                )
            if kept:  # else a sharded group's extra pass, run so the ranks' match
                parts[p] = part
                if grads is not None:
                    sums.setdefault(unit_of[p], PairwiseSum()).push(flatten(grads, params))
            del grads
    unit_sums = {u: t for u, s in sums.items() if (t := s.total()) is not None}
    every, gradient = parallel.exchange(parts, unit_sums, units)
    outputs: list[dict[str, np.ndarray]] = []
    total = 0.0
    for part in every:  # in order: the sums one process makes, however the parts were spread
        outputs.extend(part.outputs)
        total += part.loss
    if gradient is not None:  # only now, when every part succeeded
        _accumulate(masters, unflatten(gradient, masters))
    if tokens * vocab_size >= MICROBATCH_LOGITS // 4:
        # The passes' activations went back to the C heap, which keeps their pages for the
        # next pass up to a limit (`heap`); a small call frees too little to look.
        release_excess()
    return outputs, total


def optim_step(
    lora: TrainableLora, adam: AdamSpec | DimuonSpec, device: torch.device
) -> dict[str, float]:
    """Apply `lora`'s accumulated grads with its optimizer (AdamW or Dimuon, whose settings
    `adam` must be), then zero them (`TrainableLora.step`)."""
    with threads_for(OPTIMIZER_WORK_PER_PARAMETER * lora.numel(), device):
        return lora.step(adam)


def _part(
    base: Base,
    arrays: list[dict[str, np.ndarray]],
    loss: LossFn | CustomLossGraph,
    config: Mapping[str, float],
    params: list[torch.Tensor],
    forward_only: bool,
    checkpoint: bool | None,
    plan_tokens: int | None,
) -> tuple[Part, list[torch.Tensor | None] | None]:
    """One part of a forward_backward with the active adapter: its outputs and summed loss,
    and (unless `forward_only`) its own gradient, not yet added to anything."""
    outputs, part_loss = batch_loss(
        base.model, arrays, loss, config, checkpoint_layers=checkpoint, plan_tokens=plan_tokens
    )
    grads: list[torch.Tensor | None] | None = None
    if not forward_only:  # allow_unused: a parameter no path reaches gets None
        grads = list(torch.autograd.grad(part_loss, params, allow_unused=True))
    return Part(outputs, float(part_loss.detach())), grads


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """Add the request's gradient to the parameters' accumulated grads, as autograd's backward
    would have: it becomes the grad, or is added to the one accumulated before."""
    with torch.no_grad():
        for param, grad in zip(params, grads, strict=True):
            grad = grad.to(param.device)
            if param.grad is None:
                param.grad = grad  # a view of the one flat gradient
            else:
                param.grad += grad
