"""Training losses, by name, and the arrays of the data they consume.

Owns `EngineDatum`, the loss functions (`cross_entropy`, `importance_sampling`, `ppo`, `cispo`,
`dro`, `gspo`, `stable_reinforce`; their names, inputs and config ranges are
`treadle.platform.models.losses`'), the arrays a datum becomes once the platform's rules have
checked it (`validation.check_datum`, as admission does), and the padded batch forward pass that
turns them into logprobs (in chunks of the vocabulary's logits: `chunked_logprobs`) and losses. A
loss maps the target-token logprobs `lp` of the current model to an elementwise loss; the total is
its sum over tokens and datums (normalising is the client's job). Formulas and their sources:
docs/losses-and-sampling.md.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from treadle.engine.losses.chunked_logprobs import (
    FULL_LOGITS_AT_MOST,
    checkpointed_layers,
    target_logprobs,
    wants_checkpointing,
)
from treadle.engine.losses.custom_graph import CustomLossGraph, datum_outputs
from treadle.engine.models import vision
from treadle.platform.errors import ValidationError
from treadle.platform.models import custom_losses, validation
from treadle.platform.models.losses import LOSS_SPECS, LossSpec, get_loss_spec, resolve_config

__all__ = [
    "LOSSES",
    "MICROBATCH_LOGITS",
    "MICROBATCH_TOKENS",
    "EngineDatum",
    "LossFn",
    "batch_loss",
    "custom_arrays",
    "get_loss",
    "microbatches",
    "padded_tokens",
    "validate_data",
]

# The CPU's pass budget (`losses.passes.cpu_pass_tokens`): at most this many padded tokens...
MICROBATCH_TOKENS = 16384
# ...and this many logits (positions x vocabulary) a pass. Also one chunk of `chunked_logprobs`,
# and the bound on a sample batch's prefill logits. Several float32 tensors of this size live at
# once (the logits, the unembedding LoRA's delta, log-softmax and its gradient). 2**25 is 128 MiB
# a tensor, 682 tokens of a 49,152-token vocabulary; smaller passes were not slower on the CPU
# (docs/benchmarks.md, "Memory of a worker under RL"; "Memory of one long sequence" for the
# chunks).
MICROBATCH_LOGITS = 2**25

Tensor = torch.Tensor
Compute = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]


@dataclass(frozen=True)
class EngineDatum:
    """Input tokens (already flattened) and named per-token arrays, e.g. `target_tokens` int64
    [T] and `weights` float32 [T] (cross_entropy also takes both [T, K]: K targets a position,
    top-K distillation); position i of `tokens` predicts `target_tokens[i]`.
    `sampler_logprobs` (float32 [T], NaN where the target was not sampled) is what the platform
    recorded for the sequences the datum's provenance names; only losses that read provenance
    take it. `sampled_targets` (bool [T]), where the datum's provenance tiles its targets, marks
    the sampled ones (the others are prompt tokens): only the sampler-vs-trainer KL metric
    (`sampler_kl`) reads it."""

    tokens: tuple[int, ...]
    loss_fn_inputs: Mapping[str, np.ndarray]
    sampler_logprobs: np.ndarray | None = None
    sampled_targets: np.ndarray | None = None
    images: tuple[vision.EngineImage, ...] = ()  # a vision-language model's, at their tokens


@dataclass(frozen=True)
class LossFn:
    """A loss: its specification (float inputs besides `target_tokens`, config keys with defaults
    and ranges; owned by `treadle.platform.models.losses`) and
    `compute(lp_B_T, inputs, config) -> elementwise_loss_B_T`."""

    spec: LossSpec
    compute: Compute

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def float_inputs(self) -> tuple[str, ...]:
        return self.spec.float_inputs

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.spec.inputs


def _cross_entropy(lp: Tensor, x: Mapping[str, Tensor], _: Mapping[str, float]) -> Tensor:
    return -x["weights"] * lp


# importance_sampling, ppo and cispo multiply each token's term by its `weights` entry, a
# per-token mask that is all ones when a datum omits it (validate_data fills it in). Multiplying
# by 1.0 is exact, so a datum without weights gets the same bits as before the mask existed.


def _masked(term: Tensor, x: Mapping[str, Tensor]) -> Tensor:
    """`term` times the datum's `weights` (a caller computing a loss directly may omit them)."""
    weights = x.get("weights")
    return term if weights is None else term * weights


def _importance_sampling(lp: Tensor, x: Mapping[str, Tensor], _: Mapping[str, float]) -> Tensor:
    return _masked(-torch.exp(lp - x["logprobs"]) * x["advantages"], x)


def _clip(ratio: Tensor, x: Mapping[str, Tensor]) -> Tensor:
    """`ratio` clamped to each token's [clip_low_threshold, clip_high_threshold] (validate_data
    fills the loss_fn_config values in for datums that do not send them per token)."""
    return torch.clamp(ratio, x["clip_low_threshold"], x["clip_high_threshold"])


def _ppo(lp: Tensor, x: Mapping[str, Tensor], _: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(lp - x["logprobs"])
    objective = torch.minimum(ratio * x["advantages"], _clip(ratio, x) * x["advantages"])
    return _masked(-objective, x)


def _cispo(lp: Tensor, x: Mapping[str, Tensor], _: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(lp - x["logprobs"]).detach()
    return _masked(-_clip(ratio, x) * lp * x["advantages"], x)


def _dro(lp: Tensor, x: Mapping[str, Tensor], c: Mapping[str, float]) -> Tensor:
    return -(lp * x["advantages"] - 0.5 * c["beta"] * (lp - x["logprobs"]) ** 2)


def _gspo(lp_B_T: Tensor, x: Mapping[str, Tensor], _: Mapping[str, float]) -> Tensor:
    """GSPO-token: each row's sequence ratio s = exp(mean of (lp - q) over the tokens its
    sequence_ratio_mask marks) is every token's ratio in value, with the gradient of the token's
    own lp (s_t = sg(s) * exp(lp_t - sg(lp_t))), then PPO's clipped objective per token. Padding
    has mask 0, so it never enters a row's mean."""
    in_ratio_B_T = x["sequence_ratio_mask"] != 0
    log_ratio_B_T = torch.where(in_ratio_B_T, lp_B_T.detach() - x["logprobs"], 0.0)
    mean_B_1 = log_ratio_B_T.sum(-1, keepdim=True) / in_ratio_B_T.sum(-1, keepdim=True)
    ratio_B_T = torch.exp(mean_B_1 + lp_B_T - lp_B_T.detach())
    advantages_B_T = x["advantages"]
    return -torch.minimum(ratio_B_T * advantages_B_T, _clip(ratio_B_T, x) * advantages_B_T)


def _stable_reinforce(lp: Tensor, x: Mapping[str, Tensor], c: Mapping[str, float]) -> Tensor:
    """Treadle's stable_reinforce: on each sampled token, REINFORCE (-A * lp) weighted by the
    stop-gradient importance ratio r = exp(lp - q) against the recorded sampler logprob q,
    truncated at truncation_threshold and 0 outside [mask_low_threshold, mask_high_threshold].
    Prompt tokens (sampled_mask 0) contribute nothing."""
    sampled = x["sampled_mask"] != 0
    ratio = torch.exp(lp.detach() - x["sampler_logprobs"])
    kept = sampled & (ratio >= c["mask_low_threshold"]) & (ratio <= c["mask_high_threshold"])
    weight = torch.where(kept, torch.clamp(ratio, max=c["truncation_threshold"]), 0.0)
    return -weight * x["advantages"] * lp


_COMPUTE: dict[str, Compute] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    "stable_reinforce": _stable_reinforce,
}
assert set(_COMPUTE) == set(LOSS_SPECS), "every specified loss needs exactly one compute function"

LOSSES: dict[str, LossFn] = {
    name: LossFn(spec, _COMPUTE[name]) for name, spec in LOSS_SPECS.items()
}


def get_loss(name: str) -> LossFn:
    """The loss called `name`; ValidationError listing the known ones otherwise."""
    return LOSSES[get_loss_spec(name).name]


def validate_data(
    data: Sequence[EngineDatum],
    loss: LossFn,
    *,
    vocab_size: int,
    max_context_length: int,
    config: Mapping[str, float] | None = None,
    model_name: str = "the model",
) -> list[dict[str, np.ndarray]]:
    """Every datum checked for `loss` by the platform's rules (`validation.check_datum`, the
    ones admission runs); per datum its arrays (`tokens` and `target_tokens` int64, float
    inputs float32), all of length T. A per-token config input (e.g. ppo's
    `clip_low_threshold`) a datum does not send is filled with `config`'s value (the loss's
    default where `config` lacks it); an optional input (the RL losses' `weights`), with the
    value its specification gives (1.0 for `weights`).

    Raises ValidationError naming the datum index and field of the first problem.
    """
    if not data:
        raise ValidationError("data is empty; send at least one datum")
    resolved = resolve_config(loss.spec, config)
    limits = validation.Limits(model_name, vocab_size, max_context_length)
    arrays = [_arrays(i, d, loss, limits, resolved) for i, d in enumerate(data)]
    columns: list[int] = []
    for i, a in enumerate(arrays):
        validation.check_target_columns(i, a["target_tokens"], columns)
    return arrays


def _arrays(
    i: int,
    datum: EngineDatum,
    loss: LossFn,
    limits: validation.Limits,
    config: Mapping[str, float],
) -> dict[str, np.ndarray]:
    tokens = np.asarray(datum.tokens)
    inputs = {name: np.asarray(value) for name, value in datum.loss_fn_inputs.items()}
    validation.check_datum(i, tokens, inputs, loss.spec, limits)
    if datum.sampled_targets is not None and np.shape(datum.sampled_targets) != tokens.shape:
        raise ValidationError(
            f"datum {i}: its provenance marks {np.size(datum.sampled_targets)} targets, not "
            f"{tokens.size}; its target spans must tile target_tokens"
        )
    arrays = {"tokens": tokens.astype(np.int64)}
    for name in loss.spec.accepted_inputs:
        if name in loss.spec.ignored_inputs:
            continue
        if name not in inputs:  # optional: its default, or the config's value
            fill = loss.spec.optional_inputs.get(name, config.get(name))
            assert fill is not None, f"{name} is neither optional nor a per-token config key"
            arrays[name] = np.full(tokens.size, fill, np.float32)
            continue
        arrays[name] = inputs[name].astype(np.int64 if name == "target_tokens" else np.float32)
    if loss.spec.reads_provenance:
        arrays.update(_recorded_arrays(i, datum, loss, arrays["advantages"]))
    return arrays


def _recorded_arrays(
    i: int, datum: EngineDatum, loss: LossFn, advantages: np.ndarray
) -> dict[str, np.ndarray]:
    """`sampler_logprobs` (0 where not sampled) and `sampled_mask` from the recorded logprobs
    the API resolved from the datum's provenance (NaN where a target was not sampled)."""
    if datum.sampler_logprobs is None:
        raise ValidationError(
            f"datum {i}: loss {loss.name!r} reads the sampler logprobs the platform recorded, "
            "and this datum names no recorded sequence; build it with Datum.with_provenance"
        )
    recorded = np.asarray(datum.sampler_logprobs, np.float32)
    sampled = np.isfinite(recorded)
    validation.check_sampled_advantages(i, sampled, advantages, loss.spec)
    return {
        "sampler_logprobs": np.where(sampled, recorded, 0.0).astype(np.float32),
        "sampled_mask": sampled.astype(np.float32),
    }


def microbatches(
    arrays: list[dict[str, np.ndarray]], max_tokens: int
) -> list[list[dict[str, np.ndarray]]]:
    """Consecutive groups whose padded size (rows x longest) stays within `max_tokens`, the
    engine's pass budget (`losses.passes`); a datum longer than that runs alone. The logits are
    bounded apart from it: a pass computes them in chunks once they pass FULL_LOGITS_AT_MOST
    (`batch_loss`), so no pass holds [T, V] logits however many tokens it has. A datum's results
    do not depend on its group up to float rounding, so a replay groups with the budget the
    call first ran with (its result records it)."""
    assert max_tokens > 0, max_tokens
    groups: list[list[dict[str, np.ndarray]]] = []
    current: list[dict[str, np.ndarray]] = []
    width = 0
    for a in arrays:
        n = len(a["tokens"])
        if current and (len(current) + 1) * max(width, n) > max_tokens:
            groups.append(current)
            current, width = [], 0
        current.append(a)
        width = max(width, n)
    if current:
        groups.append(current)
    return groups


def padded_tokens(arrays: list[dict[str, np.ndarray]]) -> int:
    """Rows x longest: the positions one pass over `arrays` computes."""
    return len(arrays) * max(len(a["tokens"]) for a in arrays)


def batch_loss(
    model: PreTrainedModel,
    arrays: list[dict[str, np.ndarray]],
    loss: LossFn | CustomLossGraph,
    config: Mapping[str, float],
    *,
    logits_per_chunk: int | None = MICROBATCH_LOGITS,
    checkpoint_layers: bool | None = None,
    plan_tokens: int | None = None,
) -> tuple[list[dict[str, np.ndarray]], Tensor]:
    """One right-padded forward pass of validated `arrays` with whatever weights `model` runs
    now: per datum `logprobs` and `elementwise_loss` (float32 [T_i], or [T_i, K] for
    cross_entropy's top-K targets) and the summed loss, a tensor the caller may backpropagate.
    Logprobs and losses are computed in float32. A vision-language model's rows may hold
    images (`pixel_values` and `image_grid_thw` arrays from `vision.pixel_arrays`).

    The logits come at most `logits_per_chunk` at a time (None: all at once, the model's own
    forward; see `chunked_logprobs.target_logprobs`), once the pass's logits pass
    FULL_LOGITS_AT_MOST; a smaller pass computes them whole. Which way depends only on the
    pass's size, so a replay takes the same one; `plan_tokens` (a sharded group's largest
    pass, the same on every rank) stands for it where given, so that every rank takes the same
    way and runs as many chunks (`target_logprobs`). With `checkpoint_layers` the decoder layers
    are recomputed in the backward instead of keeping their activations; None decides by the
    pass's size (`wants_checkpointing`), and never while grads are off. Results are the same
    either way, up to float rounding."""
    device = next(model.parameters()).device
    lengths = [len(a["tokens"]) for a in arrays]
    width = max(lengths)

    # cross_entropy's top-K targets: the pass's [B, T, K] with K its datums' widest, a datum's
    # missing columns (a 1-D datum's past its first) target 0 with weight 0
    columns = [a["target_tokens"].shape[1] if a["target_tokens"].ndim == 2 else 0 for a in arrays]
    top_k = max(columns)
    # (a custom loss takes 1-D targets only: `custom_losses` refuses rank 2)
    rank2 = () if isinstance(loss, CustomLossGraph) else loss.spec.rank2_inputs

    def padded(name: str, dtype: torch.dtype) -> Tensor:
        if not (top_k and name in rank2):
            out_B_T = torch.zeros(len(arrays), width, dtype=dtype)
            for row, a in enumerate(arrays):
                out_B_T[row, : lengths[row]] = torch.from_numpy(a[name])
            return out_B_T.to(device)
        out_B_T_K = torch.zeros(len(arrays), width, top_k, dtype=dtype)
        for row, a in enumerate(arrays):
            value_T_K = a[name] if a[name].ndim == 2 else a[name][:, None]
            out_B_T_K[row, : lengths[row], : value_T_K.shape[1]] = torch.from_numpy(value_T_K)
        return out_B_T_K.to(device)

    mask_B_T = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(device)
    tokens_B_T = padded("tokens", torch.long)
    targets_B_T = padded("target_tokens", torch.long)
    inputs = {
        name: padded(name, torch.float32)
        for name in (() if isinstance(loss, CustomLossGraph) else loss.spec.tensor_inputs)
    }
    planned = len(arrays) * width if plan_tokens is None else plan_tokens
    if planned * model.config.vocab_size <= FULL_LOGITS_AT_MOST:
        logits_per_chunk = None  # small enough to compute whole, the fastest way
    if checkpoint_layers is None:
        checkpoint_layers = torch.is_grad_enabled() and wants_checkpointing(
            model, len(arrays) * width
        )
    with checkpointed_layers(model) if checkpoint_layers else contextlib.nullcontext():
        logprobs_B_T = target_logprobs(
            model,
            tokens_B_T,
            mask_B_T,
            targets_B_T,
            logits_per_chunk=logits_per_chunk,
            plan_tokens=plan_tokens,
            images=vision.pass_inputs(model, tokens_B_T, mask_B_T, arrays),
        )
    if isinstance(loss, CustomLossGraph):
        return _custom_outputs(loss, logprobs_B_T, arrays, lengths, device)
    kept = mask_B_T[..., None] if top_k else mask_B_T
    elementwise_B_T = torch.where(kept, loss.compute(logprobs_B_T, inputs, config), 0.0)
    logprobs_np = logprobs_B_T.detach().cpu().numpy()
    elementwise_np = elementwise_B_T.detach().cpu().numpy()

    def own(values: np.ndarray, row: int) -> np.ndarray:
        """Datum `row`'s part of a pass's [B, T] or [B, T, K] outputs, in its inputs' shape."""
        n, k = lengths[row], columns[row]
        if not top_k:
            return values[row, :n].copy()
        return values[row, :n, :k].copy() if k else values[row, :n, 0].copy()

    outputs = [
        {"logprobs": own(logprobs_np, row), "elementwise_loss": own(elementwise_np, row)}
        for row in range(len(arrays))
    ]
    return outputs, elementwise_B_T.sum()


def _custom_outputs(
    graph: CustomLossGraph,
    logprobs_B_T: Tensor,
    arrays: list[dict[str, np.ndarray]],
    lengths: list[int],
    device: torch.device,
) -> tuple[list[dict[str, np.ndarray]], Tensor]:
    """A custom loss on each datum's logprobs (`custom_graph`): per datum its `logprobs` and
    metrics, and the losses summed in datum order, as the SDK's client-side path sums them."""
    outputs: list[dict[str, np.ndarray]] = []
    total: Tensor | None = None
    for row, n in enumerate(lengths):
        logprobs_T = logprobs_B_T[row, :n]
        loss, metrics = datum_outputs(graph, logprobs_T, arrays[row], device)
        total = loss if total is None else total + loss
        outputs.append({"logprobs": logprobs_T.detach().cpu().numpy().copy(), **metrics})
    assert total is not None, "a pass holds at least one datum"
    return outputs, total


def custom_arrays(
    data: Sequence[EngineDatum],
    graph: CustomLossGraph,
    *,
    vocab_size: int,
    max_context_length: int,
    model_name: str = "the model",
) -> list[dict[str, np.ndarray]]:
    """Every datum checked for the custom loss `graph` by the platform's rules (the ones
    admission runs: `custom_losses.validate_custom_forward_backward`); per datum `tokens` and
    `target_tokens` int64 [T] and each input the loss reads, float32 of its rank."""
    if not data:
        raise ValidationError("data is empty; send at least one datum")
    limits = validation.Limits(model_name, vocab_size, max_context_length)
    loss_inputs = [{"name": name, "rank": rank} for name, rank in graph.inputs]
    out = []
    for i, datum in enumerate(data):
        tokens = np.asarray(datum.tokens)
        if "target_tokens" not in datum.loss_fn_inputs:
            raise ValidationError(f"datum {i}: loss_fn_inputs has no target_tokens")
        targets = {"target_tokens": np.asarray(datum.loss_fn_inputs["target_tokens"])}
        validation.check_datum(i, tokens, targets, custom_losses.TARGETS_ONLY, limits)
        arrays = custom_losses.check_custom_datum(i, tokens.size, datum.loss_fn_inputs, loss_inputs)
        out.append(
            {
                "tokens": tokens.astype(np.int64),
                "target_tokens": targets["target_tokens"].astype(np.int64),
                **arrays,
            }
        )
    return out
