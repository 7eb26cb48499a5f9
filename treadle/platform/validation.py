"""Admission checks for training payloads, run by the API before anything is appended, and the
limits every request is held to (docs/api.md, "Limits", lists them).

The loss table says which `loss_fn_inputs` and `loss_fn_config` keys each loss takes; the checks
name the datum and the field, and say how to fix it. The limits are checked at the edge (the API's
body reader, request schemas and protobuf decoder) before anything is allocated in proportion to
what a request declares; the engine re-checks what it relies on.
Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from treadle.platform.catalog import BaseModelInfo
from treadle.platform.errors import ValidationError
from treadle.platform.losses import get_loss_spec, resolve_config

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


def validate_forward_backward(payload: dict[str, Any], model: BaseModelInfo) -> None:
    """Check a decoded forward_backward payload; fills in the loss's config defaults."""
    spec = get_loss_spec(payload["loss_fn"])
    payload["loss_fn_config"].update(resolve_config(spec, payload["loss_fn_config"]))
    data = payload["data"]
    if not data:
        raise ValidationError("forward_backward needs at least one datum")
    if len(data) > MAX_DATUMS:
        raise ValidationError(f"{len(data)} datums in one request; send at most {MAX_DATUMS}")
    for i, datum in enumerate(data):
        _validate_datum(i, datum, spec.inputs, model)


def _validate_datum(
    i: int, datum: Mapping[str, Any], required: tuple[str, ...], model: BaseModelInfo
) -> None:
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
    for name in required:
        if name not in inputs:
            raise ValidationError(f"datum {i}: loss_fn_inputs is missing {name!r}")
        tensor = inputs[name]
        expected = "int64" if name == "target_tokens" else "float32"
        if tensor["dtype"] != expected:
            raise ValidationError(f"datum {i}: {name} must be {expected}, got {tensor['dtype']}")
        if tensor["shape"] != [n]:
            raise ValidationError(
                f"datum {i}: {name} has shape {tensor['shape']} but model_input has {n} tokens; "
                f"it must be 1-D with {n} entries"
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
