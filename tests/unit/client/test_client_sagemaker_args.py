"""Treadle's SDK takes SageMaker's training-session SDK code as typed: its ServiceClient
arguments, unnamed saves, dtype-less TensorData and a no-argument create_sampling_client, seen
in the requests they send (a fake Tinker server stands in for the network: fake_tinker)."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from fake_tinker import BASE_MODEL, FakeTinker, fake_tinker

import treadle

ROLE = "arn:aws:iam::123456789012:role/SageMakerTrainingSessionsRole"
GROUP_ARN = "arn:aws:sagemaker:us-west-2:123456789012:model-package-group/gsm8k-grpo"
SAGEMAKER_ARGS: dict[str, Any] = {"role_arn": ROLE, "region": "us-west-2"}


@pytest.fixture
def fake() -> Iterator[FakeTinker]:
    with fake_tinker() as server:
        yield server


def _service(fake: FakeTinker, **kwargs: Any) -> treadle.ServiceClient:
    return treadle.ServiceClient(base_url=fake.base_url, api_key="tml-fake-key", **kwargs)


@pytest.fixture
def svc(fake: FakeTinker) -> Iterator[treadle.ServiceClient]:
    service = _service(fake, **SAGEMAKER_ARGS)
    yield service
    service.close()


def test_the_sagemaker_arguments_are_taken_without_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the constructor made a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    svc = treadle.ServiceClient(
        base_url="http://127.0.0.1:9",
        api_key="tml-fake-key",
        region="us-west-2",
        role_arn=ROLE,
        model_package_group_arn=GROUP_ARN,
        s3_output_path="s3://my-bucket/gsm8k-grpo",
        kms_key_arn="arn:aws:kms:us-west-2:123456789012:key/abc",
        vpc_config={"subnets": ["subnet-1"], "security_group_ids": ["sg-1"]},
        session_name_prefix="gsm8k",
    )
    assert (svc.model_package_group, svc.session_name_prefix) == ("gsm8k-grpo", "gsm8k")


def test_a_region_passed_where_sagemaker_takes_it_is_refused_with_the_fix() -> None:
    with pytest.raises(treadle.ConfigurationError, match="region="):
        treadle.ServiceClient("us-west-2", api_key="tml-fake-key", role_arn=ROLE)


def test_an_arn_that_names_no_group_is_refused() -> None:
    with pytest.raises(ValueError, match="model-package-group/<name>"):
        treadle.ServiceClient(
            base_url="http://127.0.0.1:9",
            api_key="tml-fake-key",
            model_package_group_arn="arn:aws:sagemaker:us-west-2:123456789012:model-package/g/1",
        )


def test_a_session_saves_into_the_group_its_arn_names(
    svc: treadle.ServiceClient, fake: FakeTinker
) -> None:
    tc = svc.create_lora_training_client(
        BASE_MODEL,
        training_session_name="gsm8k-grpo-demo",
        rank=32,
        alpha=64,
        model_package_group_arn=GROUP_ARN,
        s3_output_path="s3://my-bucket/gsm8k-grpo",
    )
    [body] = fake.bodies("/api/v1/create_model")
    assert body["model_package_group"] == "gsm8k-grpo"
    assert body["training_session_name"] == tc.training_session_name == "gsm8k-grpo-demo"
    assert (body["lora_config"]["rank"], body["lora_config"]["alpha"]) == (32, 64)


def test_a_plain_group_name_passes_through(svc: treadle.ServiceClient, fake: FakeTinker) -> None:
    svc.create_lora_training_client(BASE_MODEL, model_package_group_arn="my-group")
    svc.create_lora_training_client(BASE_MODEL, model_package_group="other-group")
    assert [b["model_package_group"] for b in fake.bodies("/api/v1/create_model")] == [
        "my-group",
        "other-group",
    ]


def test_the_service_clients_group_is_each_sessions_unless_it_names_one(
    fake: FakeTinker,
) -> None:
    svc = _service(fake, model_package_group_arn=GROUP_ARN, **SAGEMAKER_ARGS)
    svc.create_lora_training_client(BASE_MODEL)
    svc.create_lora_training_client(BASE_MODEL, model_package_group_arn="per-session")
    svc.close()
    assert [b["model_package_group"] for b in fake.bodies("/api/v1/create_model")] == [
        "gsm8k-grpo",
        "per-session",
    ]


def test_two_different_groups_for_one_session_are_refused(svc: treadle.ServiceClient) -> None:
    with pytest.raises(ValueError, match="different groups"):
        svc.create_lora_training_client(
            BASE_MODEL, model_package_group_arn=GROUP_ARN, model_package_group="another"
        )


def test_unnamed_sessions_are_named_from_the_prefix(fake: FakeTinker) -> None:
    svc = _service(fake, session_name_prefix="gsm8k", **SAGEMAKER_ARGS)
    first = svc.create_lora_training_client(BASE_MODEL)
    second = svc.create_lora_training_client(BASE_MODEL)
    svc.close()
    names = [b["training_session_name"] for b in fake.bodies("/api/v1/create_model")]
    assert all(re.fullmatch(r"gsm8k-[0-9a-f]{8}", n) for n in names), names
    assert names == [first.training_session_name, second.training_session_name]
    assert names[0] != names[1]


def test_without_a_prefix_an_unnamed_session_stays_unnamed(
    svc: treadle.ServiceClient, fake: FakeTinker
) -> None:
    svc.create_lora_training_client(BASE_MODEL)
    assert "training_session_name" not in fake.bodies("/api/v1/create_model")[0]


def test_unnamed_saves_get_distinct_default_names(
    svc: treadle.ServiceClient, fake: FakeTinker
) -> None:
    tc = svc.create_lora_training_client(BASE_MODEL)
    paths = [
        tc.save_state("state-0001").result().path,  # a name the defaults then pass over
        tc.save_state().result().path,
        tc.save_state().result().path,
        tc.save_weights_for_sampler(merge_weights=True).result().path,
        tc.save_weights_for_sampler().result().path,
        tc.save_weights_for_sampler("w", merge_weights=True).result().path,
    ]
    states = fake.bodies("/api/v1/save_weights")
    samplers = fake.bodies("/api/v1/save_weights_for_sampler")
    assert [b["path"] for b in states] == ["state-0001", "state-0002", "state-0003"]
    assert [(b["path"], b.get("merge_weights", False)) for b in samplers] == [
        ("weights-0001", True),
        ("weights-0002", False),
        ("w", True),
    ]
    assert paths[1] == f"tinker://{tc.model_id}/weights/state-0002"
    assert paths[3] == f"tinker://{tc.model_id}/sampler_weights/weights-0001"


def test_dtype_less_tensors_are_sent_in_their_keys_dtype(
    svc: treadle.ServiceClient, fake: FakeTinker
) -> None:
    tc = svc.create_lora_training_client(BASE_MODEL)
    datum = treadle.Datum(
        model_input=treadle.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": treadle.TensorData(data=[2.0, 3.0, 4.0]),  # floats: still tokens
            "weights": treadle.TensorData(data=[0, 1, 1]),  # ints: still weights
            "logprobs": treadle.TensorData(data=[0.0, -0.5, -0.25]),
            "advantages": treadle.TensorData(data=[0.0, 1.5, 1.5]),
        },
    )
    tc.forward_backward([datum], loss_fn="ppo").result()
    [request] = fake.bodies("/api/v1/forward_backward")
    sent = request["payload"]["data"][0]["loss_fn_inputs"]
    assert {k: (t["dtype"], t["data"]) for k, t in sent.items()} == {
        "target_tokens": ("int64", [2, 3, 4]),
        "weights": ("float32", [0.0, 1.0, 1.0]),
        "logprobs": ("float32", [0.0, -0.5, -0.25]),
        "advantages": ("float32", [0.0, 1.5, 1.5]),
    }


def test_a_given_dtype_is_kept(svc: treadle.ServiceClient, fake: FakeTinker) -> None:
    tc = svc.create_lora_training_client(BASE_MODEL)
    datum = treadle.Datum(
        model_input=treadle.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={
            "target_tokens": treadle.TensorData(data=[2, 3], dtype=treadle.TensorDtype.INT32),
            "weights": treadle.TensorData(data=[1, 1], dtype=treadle.TensorDtype.FLOAT32),
        },
    )
    tc.forward_backward([datum], loss_fn="cross_entropy").result()
    sent = fake.bodies("/api/v1/forward_backward")[0]["payload"]["data"][0]["loss_fn_inputs"]
    assert (sent["target_tokens"]["dtype"], sent["weights"]["dtype"]) == ("int64", "float32")


def test_fractional_target_tokens_are_refused_before_sending(
    svc: treadle.ServiceClient, fake: FakeTinker
) -> None:
    tc = svc.create_lora_training_client(BASE_MODEL)
    datum = treadle.Datum(
        model_input=treadle.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": treadle.TensorData(data=[2.5, 3.0])},
    )
    with pytest.raises(ValueError, match="target_tokens are token ids"):
        tc.forward_backward([datum], loss_fn="cross_entropy")
    assert fake.bodies("/api/v1/forward_backward") == []


def test_create_sampling_client_without_a_path_samples_the_base_model(
    svc: treadle.ServiceClient, fake: FakeTinker
) -> None:
    tc = svc.create_lora_training_client(BASE_MODEL)
    sampler = tc.create_sampling_client()
    [body] = fake.bodies("/api/v1/create_sampling_session")
    assert (body["base_model"], body.get("model_path")) == (BASE_MODEL, None)
    assert isinstance(sampler, treadle.SamplingClient) and sampler.base_model == BASE_MODEL
    assert sampler.result() is sampler  # as tinker's future of the client resolves


def test_create_sampling_client_with_a_path_samples_that_checkpoint(
    svc: treadle.ServiceClient, fake: FakeTinker
) -> None:
    tc = svc.create_lora_training_client(BASE_MODEL)
    path = tc.save_weights_for_sampler().result().path
    tc.create_sampling_client(path)
    [body] = fake.bodies("/api/v1/create_sampling_session")
    assert (body.get("base_model"), body["model_path"]) == (None, path)


def test_the_examples_types_take_its_construction_forms() -> None:
    datum = treadle.Datum(
        model_input=treadle.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": treadle.TensorData(data=[2, 3, 4])},
    )
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]
    assert treadle.AdamParams(learning_rate=1e-5).learning_rate == 1e-5
    params = treadle.SamplingParams(max_tokens=512, temperature=0.7, top_p=0.9)
    assert (params.max_tokens, params.temperature, params.top_p) == (512, 0.7, 0.9)
    assert treadle.TensorDtype.INT64 == "int64"
