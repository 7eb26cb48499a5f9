"""The API's admission check of forward_backward payloads (`validate_forward_backward`), read
against the loss table: the optional per-token `weights` of importance_sampling, ppo and cispo
is accepted, sent or not, and checked like every other float input; losses that do not read it
refuse it by name. (tests/integration/test_validation.py sends the same through the HTTP API.)
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from treadle.platform.errors import ValidationError
from treadle.platform.models.catalog import TINY_DEBUG_NAME, get_base_model
from treadle.platform.models.losses import LOSS_SPECS
from treadle.platform.models.validation import validate_forward_backward

MASKED_LOSSES = ("importance_sampling", "ppo", "cispo")
N = 3


def tensor(values: list[float], dtype: str = "float32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": [len(values)], "data": values}


def payload(loss_fn: str, **inputs: dict[str, Any]) -> dict[str, Any]:
    """One RL datum of N tokens (target_tokens, logprobs, advantages) plus `inputs`, decoded
    the way the wire decoders hand it to validation."""
    loss_fn_inputs = {
        "target_tokens": tensor([2, 3, 4], "int64"),
        "logprobs": tensor([-1.0] * N),
        "advantages": tensor([1.0] * N),
        **inputs,
    }
    datum = {"tokens": [1, 2, 3], "loss_fn_inputs": loss_fn_inputs}
    return {"loss_fn": loss_fn, "loss_fn_config": {}, "forward_only": False, "data": [datum]}


def validate(body: dict[str, Any]) -> None:
    validate_forward_backward(body, get_base_model(TINY_DEBUG_NAME))


@pytest.mark.parametrize("loss_fn", MASKED_LOSSES)
def test_weights_are_optional_for_the_masked_losses(loss_fn: str) -> None:
    assert LOSS_SPECS[loss_fn].optional_inputs == {"weights": 1.0}
    assert "weights" not in LOSS_SPECS[loss_fn].inputs  # not required
    validate(payload(loss_fn))
    validate(payload(loss_fn, weights=tensor([0.0, 1.0, 0.5])))


@pytest.mark.parametrize("loss_fn", ["dro", "gspo", "stable_reinforce"])
def test_weights_are_refused_by_losses_that_do_not_read_them(loss_fn: str) -> None:
    body = payload(loss_fn, weights=tensor([1.0] * N), sequence_ratio_mask=tensor([1.0] * N))
    if loss_fn != "gspo":
        del body["data"][0]["loss_fn_inputs"]["sequence_ratio_mask"]
    with pytest.raises(ValidationError) as info:
        validate(body)
    assert str(info.value).startswith(
        f"datum 0: loss_fn_inputs has ['weights'], which loss {loss_fn!r} does not read; "
        "remove them (it reads ["
    )


def test_cross_entropy_still_requires_weights() -> None:
    body = payload("cross_entropy")
    inputs = body["data"][0]["loss_fn_inputs"]
    del inputs["logprobs"], inputs["advantages"]
    with pytest.raises(ValidationError, match="datum 0: loss_fn_inputs is missing 'weights'"):
        validate(body)


@pytest.mark.parametrize("loss_fn", MASKED_LOSSES)
def test_weights_of_the_wrong_length_name_the_datum_and_key(loss_fn: str) -> None:
    body = payload(loss_fn)
    body["data"].append(payload(loss_fn, weights=tensor([1.0, 0.0]))["data"][0])
    with pytest.raises(ValidationError) as info:
        validate(body)
    assert str(info.value) == (
        "datum 1: weights has shape [2] but model_input has 3 tokens; it must be 1-D with 3 entries"
    )


def test_weights_must_be_float32() -> None:
    with pytest.raises(ValidationError, match="datum 0: weights must be float32, got int64"):
        validate(payload("ppo", weights=tensor([1, 0, 1], "int64")))


@pytest.mark.parametrize("loss_fn", MASKED_LOSSES)
def test_validation_changes_nothing_in_the_payload_and_returns_the_filled_config(
    loss_fn: str,
) -> None:
    """The check reads the payload only; the loss's config with its defaults filled in (what
    the operation records) is its answer."""
    body = payload(loss_fn)
    before = copy.deepcopy(body)
    spec, config = validate_forward_backward(body, get_base_model(TINY_DEBUG_NAME))
    assert body == before
    assert spec.name == loss_fn
    assert config == {key: default for key, (default, _, _) in spec.config.items()}
