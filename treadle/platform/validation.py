"""Admission checks for training payloads, run by the API before anything is appended.

The loss table says which `loss_fn_inputs` and `loss_fn_config` keys each loss takes; the checks
name the datum and the field, and say how to fix it. The engine re-checks what it relies on.
Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from treadle.platform.catalog import BaseModelInfo
from treadle.platform.errors import ValidationError
from treadle.platform.losses import get_loss_spec, resolve_config

MAX_DATUMS = 4096


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
