"""Inflight sampling clients through the unmodified tinker SDK: every inflight sampler of a
training model follows the newest inflight save (an earlier one adopts it, a new one starts on
it), while a snapshot sampler keeps the weights of its own save."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import tinker
from tinker import types

from tests.conftest import Platform
from treadle.client.admin import AdminClient

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
PROMPT = types.ModelInput.from_ints([504, 3575, 282, 4649, 314, 7042])


@pytest.fixture(scope="module")
def training(platform: Platform) -> Iterator[tinker.TrainingClient]:
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"inflight-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    yield svc.create_lora_training_client(BASE_MODEL, rank=4, seed=3).result()
    svc.close("success").result()


def _train(tc: tinker.TrainingClient) -> None:
    tokens = [7, 11, 13, 17, 19, 23, 29]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()


def _scores(sampler: tinker.SamplingClient) -> list[float | None]:
    return sampler.compute_logprobs(PROMPT).result()


def test_inflight_samplers_follow_the_newest_inflight_save(
    training: tinker.TrainingClient,
) -> None:
    _train(training)
    first = training.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot_1 = training.save_weights_and_get_sampling_client().result()
    at_1 = _scores(first)
    assert at_1 == _scores(snapshot_1)
    _train(training)
    _train(training)
    assert _scores(first) == at_1  # training alone publishes nothing
    second = training.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot_2 = training.save_weights_and_get_sampling_client().result()
    at_2 = _scores(snapshot_2)
    assert at_2 != at_1
    assert _scores(second) == at_2
    assert _scores(first) == at_2  # the earlier inflight sampler adopted the newer weights
    assert _scores(snapshot_1) == at_1  # a snapshot keeps its own
