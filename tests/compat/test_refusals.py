"""A request refused at admission leaves no gap: the plain tinker SDK numbers it, the platform
refuses it (a loss-name typo, a missing `weights` input), and the next operation runs at once
instead of waiting out the gap timeout (60 s here) for a seq_id that will never come."""

from __future__ import annotations

import time

import pytest
import tinker
from tinker import types

from tests.conftest import Platform

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
GAP_TIMEOUT_SECONDS = 60.0  # the platform fixture's (TREADLE_GAP_TIMEOUT_SECONDS default)


def _datum(tokens: list[int], *, weights: bool = True) -> types.Datum:
    inputs: dict[str, list[int] | list[float]] = {"target_tokens": tokens[1:]}
    if weights:
        inputs["weights"] = [1.0] * (len(tokens) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def training(platform: Platform):  # type: ignore[no-untyped-def]
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=platform.admin_key)
    tc = svc.create_lora_training_client(BASE_MODEL, rank=4).result()
    tc.forward_backward([_datum([1, 2, 3, 4])], "cross_entropy").result()  # the worker is warm
    yield tc
    svc.close("success").result()


@pytest.mark.parametrize(
    ("loss_fn", "datum", "says"),
    [
        ("cross_entropyy", _datum([5, 6, 7, 8]), "cross_entropyy"),
        ("cross_entropy", _datum([5, 6, 7, 8], weights=False), "weights"),
    ],
)
def test_a_refused_request_does_not_delay_the_next_one(
    training: tinker.TrainingClient, loss_fn: str, datum: types.Datum, says: str
) -> None:
    with pytest.raises(tinker.BadRequestError, match=says):
        training.forward_backward([datum], loss_fn).result()  # type: ignore[arg-type]
    started = time.monotonic()
    result = training.forward_backward([_datum([9, 10, 11, 12])], "cross_entropy").result()
    waited = time.monotonic() - started
    assert "loss:sum" in result.metrics
    # Not a speed target: proof that the worker did not wait for the refused seq_id's gap.
    assert waited < GAP_TIMEOUT_SECONDS / 2, f"the next operation waited {waited:.1f} s"
