"""SageMaker's API through boto3 and the official SDK against the served platform (`treadle up`,
real workers), on treadle/tiny-debug: what the example test does not reach.

- The same loop through the Tinker route (Treadle's SDK) and through SageMaker's SDK, the same
  data and seeds: the same losses, samples and metered tokens.
- Server-sent events from a live session and from a saved package
  (`sample_training_session_with_response_stream`), and the whole answer
  (`sample_training_session`).
- Sequence numbers: a later number waits, the session Blocked, until the missing one arrives;
  a result is kept and fetched as often as asked.
- SigV4 over HTTP: a wrong secret, an unknown key, a revoked key, a date 10 minutes old, a
  request signed for another region or service are each refused with AWS's code.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import Any
from unittest import mock

import boto3
import botocore.auth
import httpx
import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

import treadle
from tests.compat.users import aws_env, new_aws_user
from tests.conftest import Platform
from treadle.client.admin import AdminClient
from treadle.client.billing import BillingClient
from treadle.platform.sagemaker import arns

pytestmark = pytest.mark.integration

TINY = "treadle/tiny-debug"
ROLE = "arn:aws:iam::123456789012:role/SageMakerTrainingSessionsRole"
NO_RETRIES = Config(retries={"mode": "standard", "max_attempts": 1})


def clients(platform: Platform, user: dict[str, str], region: str = "us-west-2") -> Any:
    """(control plane, runtime) boto3 clients of `user`."""
    common = {
        "endpoint_url": platform.base_url,
        "region_name": region,
        "aws_access_key_id": user["access_key_id"],
        "aws_secret_access_key": user["secret_access_key"],
        "config": NO_RETRIES,
    }
    return boto3.client("sagemaker", **common), boto3.client(
        "sagemakertrainingsessionruntime", **common
    )


def create(control: Any, name: str, group: str = "routes") -> None:
    control.create_training_session(
        TrainingSessionName=name,
        ModelPackageGroupArn=f"arn:aws:sagemaker:us-west-2:123456789012:model-package-group/{group}",
        LoraConfig={"Rank": 8, "Alpha": 16},
        RoleArn=ROLE,
        ModelConfig={"BaseModelArn": arns.hub_content_arn("us-west-2", "treadle--tiny-debug")},
        OutputConfig={"S3Location": {"Path": "s3://bucket/out"}},
    )


def status(control: Any, name: str) -> str:
    detail = control.describe_training_session(TrainingSessionName=name)
    return str(detail["TrainingSessionDetail"]["TrainingSessionStatus"])


def wait_running(control: Any, name: str) -> None:
    import time

    deadline = time.monotonic() + 120
    while status(control, name) != "Running":
        assert time.monotonic() < deadline, f"{name} never ran"
        time.sleep(0.2)


def result(runtime: Any, name: str, operation_id: str, *, sampling: bool = False) -> Any:
    get = (
        runtime.get_sampling_operation_result if sampling else runtime.get_training_operation_result
    )
    while True:  # each poll long-polls on the server
        answer = get(trainingSessionName=name, operationId=operation_id)
        if answer["status"] not in ("Pending", "InProgress"):
            return answer


def cross_entropy(seq: int, token: str) -> dict[str, Any]:
    tokens = [5 + seq, 6, 7, 8, 9]
    return {
        "sequenceNumber": seq,
        "clientToken": token,
        "operationConfig": {
            "forwardBackward": {
                "lossFnName": "cross_entropy",
                "datumList": [
                    {
                        "modelInput": {"chunks": [{"tokens": tokens[:-1], "type": "encoded_text"}]},
                        "lossFnInputs": {
                            "target_tokens": {"data": tokens[1:], "dtype": "int64"},
                            "weights": {"data": [1.0] * 4, "dtype": "float32"},
                        },
                    }
                ],
            }
        },
    }


@pytest.fixture(scope="module")
def user(platform: Platform) -> dict[str, str]:
    return new_aws_user(platform, "routes")


# --- the same loop through both surfaces ----------------------------------------------------

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32]]
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def ppo_rows(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> Any:
    """(input ids, targets, weights, logprobs, advantages) of one sampled sequence."""
    full = prompt + tokens
    n = len(prompt) - 1
    return (
        full[:-1],
        full[1:],
        [0.0] * n + [1.0] * len(tokens),
        [0.0] * n + list(logprobs),
        [0.0] * n + [advantage] * len(tokens),
    )


def sagemaker_loop(platform: Platform, user: dict[str, str]) -> dict[str, Any]:
    from sagemaker.train.training_session import (
        AdamParams,
        Datum,
        ModelInput,
        SamplingParams,
        ServiceClient,
        TensorData,
    )

    out: dict[str, Any] = {"losses": [], "samples": []}
    with mock.patch.dict(os.environ, aws_env(platform.base_url, user)):
        svc = ServiceClient(role_arn=ROLE, region="us-west-2")
        with svc.create_lora_training_client(
            TINY, training_session_name="equal-sm", rank=8, alpha=16,
            model_package_group_arn="arn:aws:sagemaker:us-west-2:123456789012:"
            "model-package-group/equal", s3_output_path="s3://bucket/equal",
        ) as tc:  # fmt: skip
            sampler = tc.create_sampling_client()
            for step in range(2):
                datums = []
                for i, prompt in enumerate(PROMPTS):
                    params = SamplingParams(max_tokens=512, temperature=1.0, seed=10 * step + i)
                    res = sampler.sample(ModelInput.from_ints(prompt), num_samples=2,
                                         sampling_params=params).result()  # fmt: skip
                    for j, seq in enumerate(res.sequences):
                        out["samples"].append(list(seq.tokens))
                        rows = ppo_rows(prompt, list(seq.tokens), seq.logprobs, 1.0 - 0.5 * j)
                        names = ("target_tokens", "weights", "logprobs", "advantages")
                        datums.append(Datum(
                            model_input=ModelInput.from_ints(rows[0]),
                            loss_fn_inputs={n: TensorData(data=v) for n, v in zip(names, rows[1:],
                                                                                  strict=True)},
                        ))  # fmt: skip
                fb = tc.forward_backward(datums, loss_fn="ppo")
                tc.optim_step(AdamParams(**ADAM)).result()
                out["losses"].append(fb.result().metrics["loss:sum"])
                sampler = tc.save_weights_and_get_sampling_client()
    return out


def tinker_loop(platform: Platform, api_key: str) -> dict[str, Any]:
    out: dict[str, Any] = {"losses": [], "samples": []}
    svc = treadle.ServiceClient(base_url=platform.base_url, api_key=api_key)
    try:
        with svc.create_lora_training_client(TINY, rank=8, alpha=16, seed=0) as tc:
            sampler = tc.create_sampling_client()
            for step in range(2):
                datums = []
                for i, prompt in enumerate(PROMPTS):
                    params = treadle.SamplingParams(max_tokens=512, temperature=1.0,
                                                    seed=10 * step + i)  # fmt: skip
                    res = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
                    for j, seq in enumerate(res.sequences):
                        out["samples"].append(list(seq.tokens))
                        rows = ppo_rows(prompt, list(seq.tokens), seq.logprobs, 1.0 - 0.5 * j)
                        datums.append(treadle.Datum(
                            model_input=treadle.ModelInput.from_ints(rows[0]),
                            loss_fn_inputs={"target_tokens": rows[1], "weights": rows[2],
                                            "logprobs": rows[3], "advantages": rows[4]},
                        ))  # fmt: skip
                fb = tc.forward_backward(datums, loss_fn="ppo")
                tc.optim_step(treadle.AdamParams(**ADAM)).result()
                out["losses"].append(fb.result().metrics["loss:sum"])
                sampler = tc.save_weights_and_get_sampling_client()
    finally:
        svc.close()
    return out


def tenant_tokens(platform: Platform, api_key: str) -> dict[str, int]:
    billing = BillingClient(platform.base_url, api_key)
    try:
        return dict(billing.get_usage().total.tokens)
    finally:
        billing.close()


def test_the_same_loop_through_both_surfaces_gives_the_same_losses_and_tokens(
    platform: Platform,
) -> None:
    through_sagemaker = new_aws_user(platform, "equal-sm")
    through_tinker = new_aws_user(platform, "equal-tinker")
    sm = sagemaker_loop(platform, through_sagemaker)
    tk = tinker_loop(platform, through_tinker["api_key"])
    assert sm["samples"] == tk["samples"]
    assert sm["losses"] == tk["losses"]
    assert all(loss != 0 for loss in sm["losses"])
    sm_tokens = tenant_tokens(platform, through_sagemaker["api_key"])
    assert sm_tokens == tenant_tokens(platform, through_tinker["api_key"])
    assert sm_tokens["train"] > 0 and sm_tokens["sample"] > 0 and sm_tokens["prefill"] > 0


# --- inference ------------------------------------------------------------------------------


def events(body: bytes) -> list[str]:
    return [line[len("data: ") :] for line in body.decode().split("\n\n") if line]


def test_chat_streams_from_a_live_session_and_from_a_saved_package(
    platform: Platform, user: dict[str, str]
) -> None:
    control, runtime = clients(platform, user)
    create(control, "chat", group="chat")
    wait_running(control, "chat")
    saved = runtime.execute_training_operation(
        trainingSessionName="chat", sequenceNumber=1, clientToken="save-1",
        operationConfig={"saveWeights": {"description": "for chat"}},
    )["operationId"]  # fmt: skip
    package = result(runtime, "chat", saved)["operationResult"]["saveWeights"]["modelPackageArn"]
    request = {"model": "anything", "max_tokens": 8, "seed": 3,
               "messages": [{"role": "user", "content": "2+2?"}]}  # fmt: skip
    for header in ({}, {"modelPackageArn": package}):
        streamed = runtime.sample_training_session_with_response_stream(
            trainingSessionName="chat", body=json.dumps({**request, "stream": True}),
            contentType="application/json", **header,
        )  # fmt: skip
        data = events(streamed["body"].read())
        assert data[-1] == "[DONE]", data
        chunks = [json.loads(d) for d in data[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        whole = runtime.sample_training_session(
            trainingSessionName="chat", body=json.dumps(request),
            contentType="application/json", **header,
        )  # fmt: skip
        answer = json.loads(whole["body"].read())
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"] == text  # same seed, same weights
    missing = package.rsplit("/", 1)[0] + "/999"
    with pytest.raises(ClientError) as refused:
        runtime.sample_training_session(
            trainingSessionName="chat", body=json.dumps(request), modelPackageArn=missing
        )
    assert refused.value.response["Error"]["Code"] == "ResourceNotFoundException"


# --- ordering -------------------------------------------------------------------------------


def test_a_later_number_waits_blocked_until_the_missing_one_arrives(
    platform: Platform, user: dict[str, str]
) -> None:
    control, runtime = clients(platform, user)
    create(control, "gaps")
    wait_running(control, "gaps")
    later = runtime.execute_training_operation(trainingSessionName="gaps", **cross_entropy(2, "b"))
    assert status(control, "gaps") == "Blocked"
    first = runtime.execute_training_operation(trainingSessionName="gaps", **cross_entropy(1, "a"))
    for answer in (first, later):
        done = result(runtime, "gaps", answer["operationId"])
        assert done["status"] == "Completed", done
    again = runtime.get_training_operation_result(
        trainingSessionName="gaps", operationId=later["operationId"]
    )
    assert again["operationResult"] == done["operationResult"]  # kept, fetched as often as asked
    assert status(control, "gaps") == "Running"
    detail = control.describe_training_session(TrainingSessionName="gaps")["TrainingSessionDetail"]
    assert detail["LastReceivedSequenceNumber"] == 2
    assert detail["BillableTokenUsage"]["TrainingTokenCount"] == 8


# --- SigV4 over HTTP ------------------------------------------------------------------------


def refused_with(call: Any) -> str:
    with pytest.raises(ClientError) as refused:
        call()
    return str(refused.value.response["Error"]["Code"])


def test_signatures_that_do_not_hold_are_refused_with_awss_codes(
    platform: Platform, user: dict[str, str]
) -> None:
    control, runtime = clients(platform, user)
    listing = {"HubName": "SageMakerPublicHub", "HubContentType": "Model"}
    assert control.list_hub_contents(**listing)["HubContentSummaries"]
    wrong = clients(platform, {**user, "secret_access_key": "x" * 40})[0]
    assert refused_with(lambda: wrong.list_hub_contents(**listing)) == "InvalidSignatureException"
    unknown = clients(platform, {**user, "access_key_id": "TRDL" + "Z" * 16})
    assert refused_with(lambda: unknown[0].list_hub_contents(**listing)) == (
        "UnrecognizedClientException"
    )
    assert (
        refused_with(
            lambda: unknown[1].get_training_operation_result(
                trainingSessionName="x", operationId="y"
            )
        )
        == "UnrecognizedClientException"
    )
    elsewhere = clients(platform, user, region="eu-central-1")[0]
    assert refused_with(lambda: elsewhere.list_hub_contents(**listing)) == (
        "InvalidSignatureException"
    )
    ten_minutes_ago = dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(minutes=10)
    with mock.patch.object(botocore.auth, "get_current_datetime", return_value=ten_minutes_ago):
        assert refused_with(lambda: control.list_hub_contents(**listing)) == (
            "InvalidSignatureException"
        )
    # signed for another service (S3) though sent to SageMaker's control plane
    body = json.dumps(listing).encode()
    request = AWSRequest(method="POST", url=f"{platform.base_url}/", data=body, headers={
        "Content-Type": "application/x-amz-json-1.1", "X-Amz-Target": "SageMaker.ListHubContents",
    })  # fmt: skip
    credentials = Credentials(user["access_key_id"], user["secret_access_key"])
    SigV4Auth(credentials, "s3", "us-west-2").add_auth(request)
    answer = httpx.post(f"{platform.base_url}/", content=body, headers=dict(request.headers))
    assert answer.status_code == 400
    assert answer.json()["__type"] == "InvalidSignatureException"
    assert "sagemaker" in answer.json()["message"]


def test_a_revoked_key_is_refused_from_its_next_request(platform: Platform) -> None:
    user = new_aws_user(platform, "revoked")
    control, runtime = clients(platform, user)
    listing = {"HubName": "SageMakerPublicHub", "HubContentType": "Model"}
    control.list_hub_contents(**listing)
    admin = AdminClient(platform.base_url, user["api_key"])
    try:
        admin.revoke_key(user["key_id"])
    finally:
        admin.close()
    import time

    time.sleep(1.1)  # another API process may have it cached for a second
    assert refused_with(lambda: control.list_hub_contents(**listing)) == (
        "UnrecognizedClientException"
    )
    assert (
        refused_with(
            lambda: runtime.get_training_operation_result(trainingSessionName="x", operationId="y")
        )
        == "UnrecognizedClientException"
    )
