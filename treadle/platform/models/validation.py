"""Admission checks for training payloads, run by the API before anything is appended, and the
limits every request is held to (docs/api.md, "Limits", lists them).

The loss table says which `loss_fn_inputs` and `loss_fn_config` keys each loss takes; the checks
name the datum and the field, and say how to fix it. The limits are checked at the edge (the API's
body reader, request schemas and protobuf decoder) before anything is allocated in proportion to
what a request declares; the engine re-checks what it relies on.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
MAX_VALUES_PER_TOKEN = 16
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


def validate_forward_backward(
    payload: Mapping[str, Any], model: BaseModelInfo
) -> tuple[LossSpec, dict[str, float]]:
    """Check a decoded forward_backward payload, changing nothing in it. Returns the loss's
    specification and its config with the loss's defaults filled in (what the operation
    records)."""
    spec = get_loss_spec(payload["loss_fn"])
    config = dict(resolve_config(spec, payload["loss_fn_config"]))
    data = payload["data"]
    if not data:
        raise ValidationError("forward_backward needs at least one datum")
    if len(data) > MAX_DATUMS:
        raise ValidationError(f"{len(data)} datums in one request; send at most {MAX_DATUMS}")
    for i, datum in enumerate(data):
        _validate_datum(i, datum, spec, model)
    return spec, config


def _validate_datum(i: int, datum: Mapping[str, Any], spec: LossSpec, model: BaseModelInfo) -> None:
    tokens = datum["tokens"]
    n = len(tokens)
    if n == 0:
        raise ValidationError(f"datum {i}: model_input is empty; give it at least one token")
    if n > model.max_context_length:
        raise ValidationError(
            f"datum {i}: model_input has {n} tokens but {model.name} takes at most "
            f"{model.max_context_length}; shorten or split it"
        )
    bad = next((t for t in tokens if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise ValidationError(
            f"datum {i}: model_input has token id {bad}, outside the vocabulary "
            f"[0, {model.vocab_size}) of {model.name}"
        )
    inputs = datum["loss_fn_inputs"]
    missing = next((name for name in spec.inputs if name not in inputs), None)
    if missing is not None:
        raise ValidationError(f"datum {i}: loss_fn_inputs is missing {missing!r}")
    unknown = sorted(set(inputs) - set(spec.accepted_inputs))
    if unknown:
        raise ValidationError(
            f"datum {i}: loss_fn_inputs has {unknown}, which loss {spec.name!r} does not read; "
            f"remove them (it reads {list(spec.accepted_inputs)})"
        )
    for name in spec.accepted_inputs:
        if name not in inputs:
            continue
        tensor = inputs[name]
        expected = "int64" if name == "target_tokens" else "float32"
        if tensor["dtype"] != expected:
            raise ValidationError(f"datum {i}: {name} must be {expected}, got {tensor['dtype']}")
        if tensor["shape"] != [n]:
            raise ValidationError(
                f"datum {i}: {name} has shape {tensor['shape']} but model_input has {n} tokens; "
                f"it must be 1-D with {n} entries"
            )
        if name in spec.per_token_config:
            check_config_values(spec, name, tensor["data"], where=f"datum {i}: {name}")
        if name in spec.nonzero_inputs and not any(tensor["data"]):
            raise ValidationError(
                f"datum {i}: {name} marks no token; give at least one token a nonzero value"
            )
    if "target_tokens" in inputs:
        bad = next(
            (t for t in inputs["target_tokens"]["data"] if not 0 <= t < model.vocab_size), None
        )
        if bad is not None:
            raise ValidationError(
                f"datum {i}: target_tokens has token id {int(bad)}, outside the vocabulary "
                f"[0, {model.vocab_size}) of {model.name}"
            )


def validate_sampled_advantages(data: list[dict[str, Any]], spec: LossSpec) -> None:
    """A loss that reads provenance weighs sampled targets only: a nonzero advantage on a
    target that is a prompt token (recorded logprob None) is refused."""
    for i, datum in enumerate(data):
        recorded = datum["provenance"]["sampler_logprobs"]
        advantages = datum["loss_fn_inputs"]["advantages"]["data"]
        j = next((j for j, q in enumerate(recorded) if q is None and advantages[j] != 0), None)
        if j is not None:
            raise ValidationError(
                f"datum {i}: advantages[{j}] is {advantages[j]} but target {j} is a prompt token "
                f"(its provenance is a prompt span), not a sampled one; {spec.name} weighs "
                "sampled tokens only: give prompt tokens advantage 0"
            )


def validate_prompt(tokens: list[int], model: BaseModelInfo, max_tokens: int) -> None:
    if not tokens:
        raise ValidationError("the prompt is empty; give it at least one token")
    bad = next((t for t in tokens if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise ValidationError(
            f"prompt has token id {bad}, outside the vocabulary [0, {model.vocab_size}) of {model.name}"
        )
    if len(tokens) + max_tokens > model.max_context_length:
        raise ValidationError(
            f"prompt ({len(tokens)} tokens) plus max_tokens ({max_tokens}) exceeds the context of "
            f"{model.name} ({model.max_context_length}); shorten the prompt or lower max_tokens"
        )


def validate_prompt_scoring(
    tokens: list[int],
    model: BaseModelInfo,
    *,
    prompt_logprobs: bool,
    last_n: int | None,
    alt_tokens_k: int,
    targets: Mapping[str, Any] | None,
) -> None:
    """The asample options that score the prompt, checked against it before anything is
    appended: `prompt_logprobs_last_n` in [1, len(prompt) - 1] and with prompt logprobs, the
    alternative draws bounded, and `target_prompt_logprobs` (its JSON TensorData form) an int64
    [len(prompt) - 1, K] table of token ids or -1 naming at least one id."""
    rows = len(tokens) - 1
    if last_n is not None:
        if not prompt_logprobs:
            raise ValidationError(
                "prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs "
                "(include_prompt_logprobs=True) too, or omit it"
            )
        if not 1 <= last_n <= rows:
            raise ValidationError(
                f"prompt_logprobs_last_n is {last_n}; it must be between 1 and len(prompt) - 1 "
                f"= {rows}"
            )
    if alt_tokens_k and len(tokens) * alt_tokens_k > MAX_PROMPT_ALT_TOKENS:
        raise ValidationError(
            f"prompt_alt_tokens_k = {alt_tokens_k} draws at each of {len(tokens)} prompt tokens "
            f"is more than {MAX_PROMPT_ALT_TOKENS} draws; lower it or shorten the prompt"
        )
    if targets is not None:
        _validate_targets(targets, rows, model)


def _validate_targets(t: Mapping[str, Any], rows: int, model: BaseModelInfo) -> None:
    where = "target_prompt_logprobs"
    if t["dtype"] != "int64":
        raise ValidationError(f"{where} must be an int64 tensor of token ids, got {t['dtype']}")
    shape = t["shape"]
    if shape is None or len(shape) != 2 or shape[0] != rows or shape[1] < 1:
        raise ValidationError(
            f"{where} has shape {shape}; it must be [len(prompt) - 1, K] = [{rows}, K] with "
            "K >= 1 (row i scores prompt position i + 1)"
        )
    if shape[1] > MAX_TARGET_PROMPT_K:
        raise ValidationError(f"{where} has {shape[1]} columns; send at most {MAX_TARGET_PROMPT_K}")
    ids, crow, col = t["data"], t["sparse_crow_indices"], t["sparse_col_indices"]
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
    if crow is None and len(ids) != rows * shape[1]:
        raise ValidationError(
            f"{where} holds {len(ids)} ids but its shape {shape} needs {rows * shape[1]}"
        )
    if crow is not None and (
        len(crow) != rows + 1
        or crow[0] != 0
        or any(b < a for a, b in zip(crow, crow[1:], strict=False))
        or crow[-1] != len(col)
        or len(col) != len(ids)
        or any(not 0 <= c < shape[1] for c in col)
    ):
        raise ValidationError(
            f"{where} is sparse CSR but its indices do not fit its shape {shape}: "
            f"sparse_crow_indices needs {rows + 1} entries from 0, never decreasing, ending at "
            "the number of sparse_col_indices; each column index must be in [0, K), with one "
            "id in data per column index"
        )
    bad = next((i for i in ids if not -1 <= i < model.vocab_size), None)
    if bad is not None:
        raise ValidationError(
            f"{where} holds {bad}, not a token id of {model.name}; use ids in "
            f"[0, {model.vocab_size}), or -1 for a cell that asks for nothing"
        )
    if all(i == -1 for i in ids):
        raise ValidationError(f"{where} names no token id (every cell is -1); name at least one")
