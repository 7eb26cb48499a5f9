"""The checks on what a request asks of a model, and the limits every request is held to
(docs/api.md, "Limits", lists them): one implementation of each rule.

The API calls them at admission, before anything is appended (`validate_forward_backward`,
`validate_prompt`, ...: the payloads as the wire decoders hand them over); the engine calls the
same rules (`check_datum`, `check_prompt`, `check_sampling`, ...) on the arrays it is given, because
what reaches it must never become a server error, whoever calls it. The loss table says which
`loss_fn_inputs` and `loss_fn_config` keys each loss takes; a message names the datum and the
field, and says how to fix it. The size limits are checked at the edge (the API's body reader,
request schemas and protobuf decoder) before anything is allocated in proportion to what a request
declares. Changes nothing it is given. Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from treadle.platform.errors import ValidationError
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.models.losses import (
    LossSpec,
    check_config_values,
    get_loss_spec,
    resolve_config,
)

# -- forward_backward (protobuf) -------------------------------------------------------------
MAX_DATUMS = 4096
# What client/config tells the tinker SDK: datums per forward_backward request (its own default).
FWDBWD_MAX_CHUNK_LEN = 1024
# Protobuf fields in one body, at every depth (a packed array counts one per byte). Bounds what
# parsing allocates per byte received: an empty message costs the parser ~56 bytes.
MAX_PROTO_FIELDS = 2**19
# A loss_fn_inputs tensor: rank 1 or 2, at most this many values per token of its datum.
MAX_TENSOR_RANK = 2
# cross_entropy's top-K targets: at most this many columns K of [T, K] target_tokens and
# weights (tinker-cookbook's top-K distillation sends K = 20).
MAX_TARGETS_PER_TOKEN = 64
MAX_VALUES_PER_TOKEN = MAX_TARGETS_PER_TOKEN
MAX_LOSS_INPUTS = 16  # tensors per datum
# Sparse tensors are stored dense, so a request may declare at most one tensor value per 4 bytes
# of its body (what a dense body carries) plus this many.
SPARSE_VALUE_ALLOWANCE = 65_536

# -- JSON bodies -----------------------------------------------------------------------------
MAX_JSON_DEPTH = 64  # arrays and objects inside each other
MAX_JSON_VALUES = 2**19
MAX_INT_DIGITS = 20  # 2**64 - 1 has 20 digits

# -- request fields --------------------------------------------------------------------------
MAX_ID_LENGTH = 512  # ids, names, paths and base model names, in characters
MAX_SEED = 2**64 - 1  # seeds (LoRA init, sampling) are unsigned 64-bit integers
MAX_TAGS = 64
MAX_TAG_LENGTH = 256
MAX_METADATA_KEYS = 64
MAX_METADATA_DEPTH = 4
MAX_METADATA_BYTES = 16_384  # as compact JSON

# -- sampling --------------------------------------------------------------------------------
MAX_NUM_SAMPLES = 128
# Sampled tokens per request (num_samples x max_tokens): what one request may make a worker hold.
MAX_SAMPLE_TOKENS = 2**18
# Temperature 0 is greedy. The worker divides float32 logits by a positive temperature: a tiny one
# overflows them to infinity and the probabilities to NaN (1e-40 fails); below MIN_TEMPERATURE
# sampling is greedy in all but name, and above MAX_TEMPERATURE it is uniform noise.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
# top_p in [MIN_TOP_P, 1]. The worker compares in float32, where a top_p below ~7e-46 is 0 and
# drops every token (the 500s a top_p of 1e-300 caused); any top_p at or below 1/vocabulary keeps
# only the likeliest token, and 1e-6 is below that for every vocabulary up to a million tokens.
MIN_TOP_P = 1e-6
MAX_TOP_K = 2**31 - 1  # -1 (or 0): no limit
MAX_STOP = 64  # stop strings or stop token ids
MAX_STOP_LENGTH = 256  # characters per stop string
MAX_TOKEN_ID = 2**31 - 1
# Top-k logprobs per position (topk_prompt_logprobs, topk_sample_logprobs).
MAX_TOPK_LOGPROBS = 20
# prompt_alt_tokens_k: draws per prompt position, and draws per request (len(prompt) x k).
MAX_PROMPT_ALT_TOKENS_K = 64
MAX_PROMPT_ALT_TOKENS = 2**18
# target_prompt_logprobs: columns K of its [len(prompt) - 1, K] table, and cells sent.
MAX_TARGET_PROMPT_K = 1024
MAX_TARGET_PROMPT_CELLS = 2**18


class ModelLimits(Protocol):
    """What a request is checked against: a `BaseModelInfo`, or `Limits` where only the numbers
    are known."""

    @property
    def name(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_context_length(self) -> int: ...


@dataclass(frozen=True)
class Limits:
    name: str
    vocab_size: int
    max_context_length: int


# -- forward_backward ------------------------------------------------------------------------


def validate_forward_backward(
    payload: Mapping[str, Any], model: BaseModelInfo
) -> tuple[LossSpec, dict[str, float]]:
    """Check a decoded forward_backward payload. Returns the loss's specification and its
    config with the loss's defaults filled in (what the operation records)."""
    spec = get_loss_spec(payload["loss_fn"])
    config = dict(resolve_config(spec, payload["loss_fn_config"]))
    data = payload["data"]
    if not data:
        raise ValidationError("forward_backward needs at least one datum")
    if len(data) > MAX_DATUMS:
        raise ValidationError(f"{len(data)} datums in one request; send at most {MAX_DATUMS}")
    columns: list[int] = []
    for i, datum in enumerate(data):
        inputs = {name: tensor_array(i, name, t) for name, t in datum["loss_fn_inputs"].items()}
        check_datum(i, _array_of(datum["tokens"], "int64"), inputs, spec, model)
        check_target_columns(i, inputs["target_tokens"], columns)
    return spec, config


def check_target_columns(i: int, target_tokens: np.ndarray, columns: list[int]) -> None:
    """Datum `i`'s targets a position (1-D: 0; [T, K]: K) equal to the request's first datum's,
    noted in `columns`: a request's `logprobs` come back as one batched tensor, whose trailing
    shape (the K) every datum shares."""
    k = int(target_tokens.shape[1]) if target_tokens.ndim == 2 else 0
    if not columns:
        columns.append(k)
        return
    if k != columns[0]:

        def described(k: int) -> str:
            return f"[N, {k}]" if k else "1-D [N]"

        raise ValidationError(
            f"datum {i}: target_tokens is {described(k)} but datum 0's is "
            f"{described(columns[0])}; every datum of one request must take the same number of "
            "targets per token (its logprobs come back as one batched tensor): send the others "
            "in another request, or pad K with weight 0"
        )


def tensor_array(i: int, name: str, tensor: Mapping[str, Any]) -> np.ndarray:
    """A decoded TensorData (dtype, shape, flat data) as the array it describes."""
    if tensor["dtype"] not in ("int64", "float32"):
        raise ValidationError(
            f"datum {i}: {name} has dtype {tensor['dtype']!r}; send int64 or float32"
        )
    shape = tensor["shape"] or [len(tensor["data"])]
    if math.prod(shape) != len(tensor["data"]):
        raise ValidationError(
            f"datum {i}: {name} has {len(tensor['data'])} values but its shape {shape} holds "
            f"{math.prod(shape)}; its data must match its shape"
        )
    return _array_of(tensor["data"], tensor["dtype"]).reshape(shape)


def _array_of(values: Sequence[Any], dtype: str) -> np.ndarray:
    try:
        return np.asarray(values, np.dtype(dtype))
    except OverflowError:  # an id past 64 bits stays a Python int, for the vocabulary's check
        return np.asarray(values, object)


def check_datum(
    i: int,
    tokens: np.ndarray,
    inputs: Mapping[str, np.ndarray],
    spec: LossSpec,
    model: ModelLimits,
) -> None:
    """Datum `i` of a forward_backward for loss `spec`: its tokens fit the model, and its
    `loss_fn_inputs` are the ones the loss reads, each 1-D, one entry per token (or, for the
    loss's `rank2_inputs`, all of them [T, K]), of its dtype (`target_tokens` int64 token ids,
    the rest finite float32), within its per-token range."""
    n = tokens.size
    if n == 0:
        raise ValidationError(f"datum {i}: model_input is empty; give it at least one token")
    if n > model.max_context_length:
        raise ValidationError(
            f"datum {i}: model_input has {n} tokens but {model.name} takes at most "
            f"{model.max_context_length}; shorten or split it"
        )
    check_token_ids(f"datum {i}: model_input", "model_input", tokens, model)
    missing = [name for name in spec.inputs if name not in inputs]
    if missing:
        raise ValidationError(
            f"datum {i}: loss_fn_inputs is missing {missing[0]!r}: loss {spec.name!r} needs "
            f"{list(spec.inputs)}, and the datum lacks {missing}"
        )
    unknown = sorted(set(inputs) - set(spec.accepted_inputs))
    if unknown:
        raise ValidationError(
            f"datum {i}: loss_fn_inputs has {unknown}, which loss {spec.name!r} does not read; "
            f"remove them (it reads {list(spec.accepted_inputs)})"
        )
    _check_rank2(i, inputs, n, spec)
    for name in spec.accepted_inputs:
        if name in inputs:
            _check_input(i, name, inputs[name], n, spec, model)


def _check_rank2(i: int, inputs: Mapping[str, np.ndarray], n: int, spec: LossSpec) -> None:
    """[T, K] inputs only where the loss takes them (cross_entropy's top-K target_tokens and
    weights), then every one of those the same shape [T, K] with 1 <= K <= MAX_TARGETS_PER_TOKEN;
    `_check_input` checks the rest (and refuses any other shape)."""
    # in the loss's order, not the request's (a protobuf map's order is arbitrary)
    rank2 = {k: inputs[k] for k in spec.accepted_inputs if k in inputs and inputs[k].ndim == 2}
    if not rank2:
        return
    name, value = next(iter(rank2.items()))
    if not spec.rank2_inputs:
        raise ValidationError(
            f"datum {i}: {name} has shape {list(value.shape)}; loss {spec.name!r} takes 1-D "
            f"inputs, one value per token of model_input ({n}). Only cross_entropy takes "
            "[N, K] target_tokens and weights (top-K distillation)"
        )
    for name, value in rank2.items():
        if name not in spec.rank2_inputs:
            continue  # _check_input refuses it
        if value.shape[0] != n or not 1 <= value.shape[1] <= MAX_TARGETS_PER_TOKEN:
            raise ValidationError(
                f"datum {i}: {name} has shape {list(value.shape)} but model_input has {n} "
                f"tokens; a 2-D {name} must be [{n}, K] with K between 1 and "
                f"{MAX_TARGETS_PER_TOKEN}"
            )
    shapes = {name: list(inputs[name].shape) for name in spec.rank2_inputs if name in inputs}
    if len({tuple(s) for s in shapes.values()}) > 1:
        described = " and ".join(f"{name} has shape {s}" for name, s in shapes.items())
        raise ValidationError(
            f"datum {i}: {described}; {' and '.join(shapes)} must have the same shape, both "
            f"[{n}] (one target per token) or both [{n}, K] (K targets per token)"
        )


def _check_input(
    i: int, name: str, value: np.ndarray, n: int, spec: LossSpec, model: ModelLimits
) -> None:
    ids = name == "target_tokens"
    kind = np.integer if ids else np.floating
    if value.size and not np.issubdtype(value.dtype, kind):
        raise ValidationError(
            f"datum {i}: {name} must be {'int64' if ids else 'float32'}, got {value.dtype}"
        )
    top_k = name in spec.rank2_inputs and value.ndim == 2  # its shape checked by _check_rank2
    if value.shape != (n,) and not top_k:
        also = f" (or [{n}, K] for loss {spec.name!r})" if name in spec.rank2_inputs else ""
        raise ValidationError(
            f"datum {i}: {name} has shape {list(value.shape)} but model_input has {n} tokens; "
            f"it must be 1-D with {n} entries{also}"
        )
    if ids:
        check_token_ids(f"datum {i}: {name}", name, value, model)
        return
    if not np.isfinite(value).all():
        raise ValidationError(f"datum {i}: {name} must hold finite numbers only")
    if name in spec.per_token_config:
        check_config_values(spec, name, value.tolist(), where=f"datum {i}: {name}")
    if name in spec.nonzero_inputs and not value.any():
        raise ValidationError(
            f"datum {i}: {name} marks no token; give at least one token a nonzero value"
        )


def check_token_ids(where: str, name: str, ids: np.ndarray, model: ModelLimits) -> None:
    """Every entry of `ids` (called `name`) an integer in [0, vocabulary)."""
    integer = np.issubdtype(ids.dtype, np.integer) or (
        ids.dtype == object and all(isinstance(v, int) for v in ids.flat)
    )
    if ids.size and not integer:
        raise ValidationError(f"{where} must hold integer token ids, got {ids.dtype}")
    bad = np.flatnonzero((ids < 0) | (ids >= model.vocab_size))
    if bad.size:
        at = np.unravel_index(int(bad[0]), ids.shape)
        index = ", ".join(str(int(j)) for j in at)
        raise ValidationError(
            f"{where} has token id {int(ids[at])} at {name}[{index}], outside the vocabulary "
            f"[0, {model.vocab_size}) of {model.name}"
        )


def validate_sampled_advantages(data: list[dict[str, Any]], spec: LossSpec) -> None:
    """`check_sampled_advantages` on each datum of a payload whose provenance was resolved (a
    recorded logprob None: a prompt token)."""
    for i, datum in enumerate(data):
        recorded = datum["provenance"]["sampler_logprobs"]
        sampled = np.asarray([q is not None for q in recorded], bool)
        advantages = np.asarray(datum["loss_fn_inputs"]["advantages"]["data"], np.float64)
        check_sampled_advantages(i, sampled, advantages, spec)


def check_sampled_advantages(
    i: int, sampled: np.ndarray, advantages: np.ndarray, spec: LossSpec
) -> None:
    """A loss that reads provenance weighs sampled targets only: a nonzero advantage on a target
    that was not sampled (a prompt token: it has no sampler logprob to weigh it by) is refused."""
    if sampled.shape != advantages.shape:
        raise ValidationError(
            f"datum {i}: its recorded logprobs cover {sampled.size} targets, not {advantages.size}"
        )
    unweighable = np.flatnonzero(~sampled & (advantages != 0))
    if unweighable.size:
        j = int(unweighable[0])
        raise ValidationError(
            f"datum {i}: advantages[{j}] is nonzero ({float(advantages[j])}) but target {j} is a "
            "prompt token (its provenance is a prompt span), not a sampled one; "
            f"{spec.name} weighs sampled tokens only: give prompt tokens advantage 0"
        )


# -- sampling --------------------------------------------------------------------------------


def validate_prompt(tokens: list[int], model: BaseModelInfo, max_tokens: int) -> None:
    check_prompt(_array_of(tokens, "int64"), max_tokens, model)


def check_prompt(tokens: np.ndarray, max_tokens: int, model: ModelLimits) -> None:
    """A prompt of token ids of the model with room for `max_tokens` after it."""
    if tokens.size == 0:
        raise ValidationError("the prompt is empty; give it at least one token")
    check_token_ids("prompt", "prompt", tokens, model)
    if max_tokens < 0:
        raise ValidationError(f"max_tokens is {max_tokens}; it must be 0 or more")
    if tokens.size + max_tokens > model.max_context_length:
        raise ValidationError(
            f"prompt ({tokens.size} tokens) plus max_tokens ({max_tokens}) exceeds the context of "
            f"{model.name}, whose maximum context is {model.max_context_length} tokens; shorten "
            "the prompt or lower max_tokens"
        )


def check_sampling(
    num_samples: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    stop: Sequence[str] | Sequence[int],
) -> None:
    """The sampling parameters within the limits above (the API's request schemas declare the
    same bounds, so a request that breaks one is refused before it is appended)."""
    if num_samples < 1:
        raise ValidationError(f"num_samples is {num_samples}; it must be at least 1")
    if not (temperature == 0.0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise ValidationError(
            f"temperature is {temperature}; use 0 (greedy) or a value in "
            f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]"
        )
    if top_k < -1:
        raise ValidationError(f"top_k is {top_k}; use -1 for no limit or a positive k")
    if not MIN_TOP_P <= top_p <= 1.0:
        raise ValidationError(f"top_p is {top_p}; it must be in [{MIN_TOP_P}, 1]")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ValidationError(f"seed is {seed}; it must be in [0, 2**64 - 1]")
    if not (all(isinstance(s, str) for s in stop) or all(isinstance(s, int) for s in stop)):
        raise ValidationError("stop must be all strings or all token ids, not a mix")
    if any(isinstance(s, str) and not s for s in stop):
        raise ValidationError("stop holds an empty string; remove it")


def validate_prompt_scoring(
    tokens: list[int],
    model: BaseModelInfo,
    *,
    prompt_logprobs: bool,
    topk: int,
    last_n: int | None,
    alt_tokens_k: int,
    targets: Mapping[str, Any] | None,
) -> None:
    """The asample options that score the prompt, checked against it before anything is
    appended; `targets` is `target_prompt_logprobs` in its JSON TensorData form."""
    check_prompt_scoring(
        len(tokens), model, logprobs=prompt_logprobs, topk=topk, last_n=last_n, alt_k=alt_tokens_k
    )
    if targets is None:
        return
    if targets["dtype"] != "int64":
        raise ValidationError(
            f"target_prompt_logprobs must be an int64 tensor of token ids, got {targets['dtype']}"
        )
    check_prompt_targets(
        len(tokens),
        targets["shape"],
        targets["data"],
        targets["sparse_crow_indices"],
        targets["sparse_col_indices"],
        model,
    )


def check_prompt_scoring(
    prompt_length: int,
    model: ModelLimits,
    *,
    logprobs: bool,
    topk: int,
    last_n: int | None,
    alt_k: int,
    topk_sample: int = 0,
) -> None:
    """`last_n` in [1, len(prompt) - 1] and with prompt logprobs (or their top-k); top-k counts
    within the vocabulary; the alternative draws bounded."""
    rows = prompt_length - 1
    for name, k in (("topk_prompt_logprobs", topk), ("topk_sample_logprobs", topk_sample)):
        if not 0 <= k <= model.vocab_size:
            raise ValidationError(
                f"{name} is {k}; it must be between 0 (off) and the vocabulary size "
                f"{model.vocab_size}"
            )
    if last_n is not None:
        if not (logprobs or topk):
            raise ValidationError(
                "prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs "
                "(include_prompt_logprobs=True) too, or omit it"
            )
        if not 1 <= last_n <= rows:
            raise ValidationError(
                f"prompt_logprobs_last_n is {last_n}; it must be between 1 and len(prompt) - 1 "
                f"= {rows}"
            )
    if alt_k < 0:
        raise ValidationError(f"prompt_alt_tokens_k is {alt_k}; use 0 (off) or more")
    if prompt_length * alt_k > MAX_PROMPT_ALT_TOKENS:
        raise ValidationError(
            f"prompt_alt_tokens_k = {alt_k} draws at each of {prompt_length} prompt tokens "
            f"is more than {MAX_PROMPT_ALT_TOKENS} draws; lower it or shorten the prompt"
        )


def check_prompt_targets(
    prompt_length: int,
    shape: Sequence[int] | None,
    ids: Sequence[int],
    crow: Sequence[int] | None,
    col: Sequence[int] | None,
    model: ModelLimits,
) -> None:
    """`target_prompt_logprobs`: an int64 [len(prompt) - 1, K] table of token ids or -1 (row i
    scores prompt position i + 1), dense (`ids` row-major) or sparse CSR (`crow`, `col`; `ids`
    holds the listed cells only), naming at least one id."""
    where, rows = "target_prompt_logprobs", prompt_length - 1
    if shape is None or len(shape) != 2 or shape[0] != rows or shape[1] < 1:
        raise ValidationError(
            f"{where} has shape {None if shape is None else list(shape)}; it must be "
            f"[len(prompt) - 1, K] = [{rows}, K] with K >= 1 (row i scores prompt position i + 1)"
        )
    k = shape[1]
    if k > MAX_TARGET_PROMPT_K:
        raise ValidationError(f"{where} has {k} columns; send at most {MAX_TARGET_PROMPT_K}")
    if len(ids) > MAX_TARGET_PROMPT_CELLS:
        raise ValidationError(
            f"{where} sends {len(ids)} cells; send at most {MAX_TARGET_PROMPT_CELLS} (a sparse "
            "CSR tensor sends only the cells it names)"
        )
    if (crow is None) != (col is None):
        raise ValidationError(
            f"{where}: sparse_crow_indices and sparse_col_indices come together; send both "
            "(sparse CSR) or neither (dense)"
        )
    if crow is None and len(ids) != rows * k:
        raise ValidationError(
            f"{where} holds {len(ids)} ids but its shape {list(shape)} needs {rows * k}"
        )
    if crow is not None and col is not None:
        crow_, col_ = np.asarray(crow, np.int64), np.asarray(col, np.int64)
        if (
            crow_.size != rows + 1
            or crow_[0] != 0
            or (np.diff(crow_) < 0).any()
            or crow_[-1] != col_.size
            or col_.size != len(ids)
            or (col_.size and (col_.min() < 0 or col_.max() >= k))
        ):
            raise ValidationError(
                f"{where} is sparse CSR but its indices do not fit its shape {list(shape)}: "
                f"sparse_crow_indices needs {rows + 1} entries from 0, never decreasing, ending "
                "at the number of sparse_col_indices; each column index must be in [0, K), with "
                "one id in data per column index"
            )
    ids_ = np.asarray(ids, np.int64)
    bad = np.flatnonzero((ids_ < -1) | (ids_ >= model.vocab_size))
    if bad.size:
        raise ValidationError(
            f"{where} holds {int(ids_[bad[0]])}, not a token id of {model.name}; use ids in "
            f"[0, {model.vocab_size}), or -1 for a cell that asks for nothing"
        )
    if not (ids_ >= 0).any():
        raise ValidationError(f"{where} names no token id (every cell is -1); name at least one")
