"""Answers lost on the network, through the unmodified tinker SDK: the platform admits a request
and answers, the answer never arrives, the SDK sends the request again. The retry must find the
operation it repeats (same future, run once), never a conflict that ends the user's run."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
import tinker
from tinker import types

from tests.compat.lossy_proxy import lossy_proxy
from tests.conftest import Platform, new_tenant_key
from treadle.platform import db
from treadle.platform.eventlog import events

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
TOKENS = [7, 11, 13, 17, 19, 23, 29]
PROMPT = types.ModelInput.from_ints([504, 3575, 282, 4649])


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    return new_tenant_key(platform, "lost")


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


def _requests(platform: Platform, model_id: str) -> list[tuple[int, str]]:
    """(seq_id, type) of each training operation requested in the session's log."""
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            stream = events.read_stream(conn, model_id)
    finally:
        engine.dispose()
    requested = [e.data for e in stream if e.type == "OperationRequested"]
    return [(r["seq_id"], r["type"]) for r in requested if r["sampler_id"] is None]


@pytest.mark.parametrize("lost", ["/save_weights_for_sampler", "/forward_backward"])
def test_a_retry_after_a_lost_answer_gets_the_operation_it_repeats(
    platform: Platform, key: str, lost: str
) -> None:
    port = urlsplit(platform.base_url).port
    assert port is not None
    with (
        lossy_proxy(port, lose=(lost,)) as proxy,
        tinker.ServiceClient(base_url=proxy.base_url, api_key=key) as svc,
    ):
        training = svc.create_lora_training_client(BASE_MODEL, rank=4, seed=5).result()
        loss = training.forward_backward([_datum()], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=0.05)).result()
        # An unnamed save: the SDK numbers its sampler inside its retry loop, so its retry
        # names another sampler than the request the platform admitted.
        sampler = training.save_weights_and_get_sampling_client().result()
        again = training.save_weights_and_get_sampling_client().result()
        # Both samplers hold the weights after the step: the retried save did save them.
        assert sampler.compute_logprobs(PROMPT).result() == again.compute_logprobs(PROMPT).result()
        model_id = training.model_id

    assert proxy.lost == [lost]  # the answer was lost, and the SDK retried
    assert loss.metrics["loss:sum"] > 0
    assert _requests(platform, model_id) == [
        (0, "create_model"),
        (1, "forward_backward"),
        (2, "optim_step"),
        (3, "save_weights_for_sampler"),
        (4, "save_weights_for_sampler"),
    ]  # each once
