"""The SageMaker validator against botocore's own service models: requests built by the official
SDK's types and serialised by botocore pass, and each kind of violation is named in AWS's words."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from botocore.loaders import create_loader
from botocore.model import ServiceModel
from botocore.serialize import create_serializer
from sagemaker.train.training_session.types import (
    AdamParams,
    Datum,
    ModelInput,
    SamplingParams,
)

from treadle.api.sagemaker.shapes import MAX_REPORTED, ServiceShapes
from treadle.platform.errors import ValidationError

RUNTIME = "sagemakertrainingsessionruntime"
CONTROL = "sagemaker"
ACCOUNT = "123456789012"
GROUP_ARN = f"arn:aws:sagemaker:us-west-2:{ACCOUNT}:model-package-group/gsm8k-grpo"
PACKAGE_ARN = f"arn:aws:sagemaker:us-west-2:{ACCOUNT}:model-package/gsm8k-grpo/1"
BASE_MODEL_ARN = (
    "arn:aws:sagemaker:us-west-2:aws:hub-content/SageMakerPublicHub/Model/"
    "openai-reasoning-gpt-oss-20b/1.0.0"
)
SESSION_ARN = f"arn:aws:sagemaker:us-west-2:{ACCOUNT}:training-session/gsm8k-grpo-demo"


def wire(service: str, operation: str, params: dict[str, Any]) -> dict[str, Any]:
    """What the surface hands the validator for `params` sent through botocore: the JSON body
    botocore serialises (after its own client-side checks), with the URI and header members
    merged back under their member names and a payload blob as the raw body bytes."""
    model = ServiceShapes.of(service).model
    operation_model = model.operation_model(operation)
    serializer = create_serializer(model.metadata["protocol"], include_validation=True)
    request = serializer.serialize_to_request(params, operation_model)
    shape = operation_model.input_shape
    payload = shape.serialization.get("payload")
    if payload is not None:
        body = {payload: request["body"]} if request["body"] else {}
    else:
        body = json.loads(request["body"] or b"{}")
    for name, member in shape.members.items():
        if member.serialization.get("location") in ("uri", "header") and name in params:
            body[name] = params[name]
    return body


def refusal(service: str, operation: str, params: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        ServiceShapes.of(service).validate_input(operation, params)
    return caught.value.message


def output_refusal(service: str, operation: str, data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        ServiceShapes.of(service).validate_output(operation, data)
    return caught.value.message


def aws(path: str, constraint: str, value: str | None = None) -> str:
    """One violation in AWS's wording; `value` is already quoted as AWS quotes it."""
    shown = f" {value}" if value is not None else ""
    return f"Value{shown} at '{path}' failed to satisfy constraint: {constraint}"


def one(problem: str) -> str:
    return f"1 validation error detected: {problem}"


def _ppo_datum() -> dict[str, Any]:
    datum = Datum(
        model_input=ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4, 5],
            "weights": [0.0, 1.0, 1.0, 1.0],
            "logprobs": [-1.0, -0.5, -0.25, -0.125],
            "advantages": [0.0, 0.5, 0.5, 0.5],
        },
    )
    return datum._to_api()


def forward_backward() -> dict[str, Any]:
    """ExecuteTrainingOperation as `forward_backward(datums, loss_fn="ppo")` sends it."""
    return {
        "trainingSessionName": "gsm8k-grpo-demo",
        "sequenceNumber": 1,
        "clientToken": "0b7f6a9e-3c1d-4f55-9a51-2f0f7c0b8f11",
        "operationConfig": {
            "forwardBackward": {
                "lossFnName": "ppo",
                "datumList": [_ppo_datum()],
                "lossFnConfig": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            }
        },
    }


def optimizer_step() -> dict[str, Any]:
    """ExecuteTrainingOperation as `optim_step(AdamParams(learning_rate=1e-5))` sends it."""
    return {
        "trainingSessionName": "gsm8k-grpo-demo",
        "sequenceNumber": 2,
        "clientToken": "5d0b0a52-7c55-4d6e-8f43-4a0c1b6d7e21",
        "operationConfig": {
            "optimizerStep": {"adamParamsConfig": AdamParams(learning_rate=1e-5)._to_api()}
        },
    }


def sample() -> dict[str, Any]:
    """ExecuteSamplingOperation as `sample(prompt, num_samples=2, sampling_params=...)` sends it
    from a sampler made by `save_weights_and_get_sampling_client()`."""
    params = SamplingParams(max_tokens=512, temperature=0.7, top_p=0.9, stop=["\n\n"])
    return {
        "trainingSessionName": "gsm8k-grpo-demo",
        "operationConfig": {
            "sample": {
                "prompt": ModelInput.from_ints([1, 2, 3, 4])._to_api(),
                "numSamples": 2,
                "samplingParams": params._to_api(),
                "modelPackageArn": PACKAGE_ARN,
                "includePromptLogprobs": True,
                "topkPromptLogprobs": 2,
            }
        },
    }


def create_training_session() -> dict[str, Any]:
    """CreateTrainingSession with every member the SDK sends, VpcConfig and Tags included."""
    return {
        "TrainingSessionName": "gsm8k-grpo-demo",
        "ModelPackageGroupArn": GROUP_ARN,
        "LoraConfig": {"Rank": 32, "Alpha": 64},
        "RoleArn": f"arn:aws:iam::{ACCOUNT}:role/service-role/SageMakerTrainingRole",
        "ModelConfig": {"BaseModelArn": BASE_MODEL_ARN},
        "OutputConfig": {
            "S3Location": {
                "Path": "s3://my-bucket/gsm8k-grpo/",
                "KmsKeyArn": f"arn:aws:kms:us-west-2:{ACCOUNT}:key/1a2b3c4d-5e6f-7a8b-9c0d",
            }
        },
        "VpcConfig": {"SecurityGroupIds": ["sg-0123456789abcdef0"], "Subnets": ["subnet-0a1b2c"]},
        "Tags": [{"Key": "project", "Value": "gsm8k"}],
    }


def _case_id(value: object) -> str:
    """A test id: the service, the operation, then the member of its operationConfig union."""
    if isinstance(value, dict):
        return next(iter(value.get("operationConfig", {})), "")
    return str(value)


# -- requests as the SDK sends them --------------------------------------------------------------


@pytest.mark.parametrize(
    ("service", "operation", "params"),
    [
        (CONTROL, "CreateTrainingSession", create_training_session()),
        (CONTROL, "DescribeTrainingSession", {"TrainingSessionName": "gsm8k-grpo-demo"}),
        (
            CONTROL,
            "ListTrainingSessions",
            {
                "MaxResults": 100,
                "CreationTimeAfter": datetime(2025, 1, 1, tzinfo=UTC),
                "StatusEquals": "Running",
            },
        ),
        (CONTROL, "StopTrainingSession", {"TrainingSessionName": "gsm8k-grpo-demo"}),
        (CONTROL, "ListHubContents", {"HubName": "SageMakerPublicHub", "HubContentType": "Model"}),
        (
            CONTROL,
            "DescribeHubContent",
            {
                "HubName": "SageMakerPublicHub",
                "HubContentType": "Model",
                "HubContentName": "openai-reasoning-gpt-oss-20b",
            },
        ),
        (
            CONTROL,
            "ListModelPackages",
            {
                "ModelPackageGroupName": GROUP_ARN,
                "SortBy": "CreationTime",
                "SortOrder": "Descending",
                "MaxResults": 10,
            },
        ),
        (CONTROL, "DescribeModelPackage", {"ModelPackageName": PACKAGE_ARN}),
        (CONTROL, "DeleteModelPackage", {"ModelPackageName": PACKAGE_ARN}),
        (CONTROL, "CreateModelPackageGroup", {"ModelPackageGroupName": "sagemaker-default"}),
        (CONTROL, "DescribeModelPackageGroup", {"ModelPackageGroupName": "sagemaker-default"}),
        (RUNTIME, "ExecuteTrainingOperation", forward_backward()),
        (RUNTIME, "ExecuteTrainingOperation", optimizer_step()),
        (
            RUNTIME,
            "ExecuteTrainingOperation",
            {
                "trainingSessionName": "gsm8k-grpo-demo-resume",
                "sequenceNumber": 1,
                "clientToken": "e1d6f2a0-9b1c-4a47-8a5e-3c2b1d0e9f87",
                "operationConfig": {
                    "loadState": {"modelPackageArn": PACKAGE_ARN, "loadOptimizer": True}
                },
            },
        ),
        (RUNTIME, "ExecuteSamplingOperation", sample()),
        (
            RUNTIME,
            "GetTrainingOperationResult",
            {"trainingSessionName": "gsm8k-grpo-demo", "operationId": "519fc208-8d2c-4014"},
        ),
        (
            RUNTIME,
            "SampleTrainingSession",
            {
                "trainingSessionName": "gsm8k-grpo-demo",
                "contentType": "application/json",
                "accept": "application/json",
                "modelPackageArn": PACKAGE_ARN,
                "body": b'{"model": "x", "messages": [{"role": "user", "content": "2+2?"}]}',
            },
        ),
    ],
    ids=_case_id,
)
def test_request_as_the_sdk_sends_it_passes(
    service: str, operation: str, params: dict[str, Any]
) -> None:
    ServiceShapes.of(service).validate_input(operation, wire(service, operation, params))


def test_null_member_counts_as_absent() -> None:
    request = optimizer_step()
    request["clientToken"] = None
    ServiceShapes.of(RUNTIME).validate_input("ExecuteTrainingOperation", request)


def test_timestamp_may_be_an_iso_8601_string() -> None:
    params = {"CreationTimeAfter": "2025-01-01T00:00:00Z", "CreationTimeBefore": 1767225600.5}
    ServiceShapes.of(CONTROL).validate_input("ListTrainingSessions", params)


# -- each kind of violation, with its path and wording --------------------------------------------


def test_pattern_violation_quotes_the_models_pattern() -> None:
    request = optimizer_step()
    request["trainingSessionName"] = "a_b"
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        aws(
            "trainingSessionName",
            "Member must satisfy regular expression pattern: [a-zA-Z0-9-]+",
            "'a_b'",
        )
    )


def test_name_over_the_maximum_length_is_refused_for_its_length() -> None:
    request = create_training_session()
    request["TrainingSessionName"] = "a" * 64
    assert refusal(CONTROL, "CreateTrainingSession", request) == one(
        aws(
            "trainingSessionName",
            "Member must have length less than or equal to 63",
            f"'{'a' * 64}'",
        )
    )


def test_learning_rate_over_its_maximum_is_refused() -> None:
    request = optimizer_step()
    request["operationConfig"]["optimizerStep"]["adamParamsConfig"]["learningRate"] = 0.02
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        aws(
            "operationConfig.optimizerStep.adamParamsConfig.learningRate",
            "Member must have value less than or equal to 0.01",
            "'0.02'",
        )
    )


def test_max_tokens_under_its_minimum_is_refused() -> None:
    request = sample()
    request["operationConfig"]["sample"]["samplingParams"]["maxTokens"] = 100
    assert refusal(RUNTIME, "ExecuteSamplingOperation", request) == one(
        aws(
            "operationConfig.sample.samplingParams.maxTokens",
            "Member must have value greater than or equal to 512",
            "'100'",
        )
    )


def test_num_samples_over_its_maximum_is_refused() -> None:
    request = sample()
    request["operationConfig"]["sample"]["numSamples"] = 1001
    assert refusal(RUNTIME, "ExecuteSamplingOperation", request) == one(
        aws(
            "operationConfig.sample.numSamples",
            "Member must have value less than or equal to 1000",
            "'1001'",
        )
    )


def test_integer_beyond_32_bits_is_refused() -> None:
    request = sample()
    request["operationConfig"]["sample"]["samplingParams"]["seed"] = 2**31
    assert refusal(RUNTIME, "ExecuteSamplingOperation", request) == one(
        aws(
            "operationConfig.sample.samplingParams.seed",
            "Member must have value less than or equal to 2147483647",
            "'2147483648'",
        )
    )


def test_unknown_enum_value_lists_the_enum() -> None:
    request = forward_backward()
    request["operationConfig"]["forwardBackward"]["lossFnName"] = "dpo"
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        aws(
            "operationConfig.forwardBackward.lossFnName",
            "Member must satisfy enum value set: [cross_entropy, importance_sampling, ppo, cispo]",
            "'dpo'",
        )
    )


def test_missing_required_member_is_null() -> None:
    request = optimizer_step()
    del request["sequenceNumber"]
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        aws("sequenceNumber", "Member must not be null", "null")
    )


def test_missing_required_member_of_the_control_plane_is_named_as_aws_names_it() -> None:
    request = create_training_session()
    del request["LoraConfig"]["Alpha"]
    assert refusal(CONTROL, "CreateTrainingSession", request) == one(
        aws("loraConfig.alpha", "Member must not be null", "null")
    )


def test_unknown_top_level_member_lists_the_accepted_ones() -> None:
    request = optimizer_step()
    request["seqId"] = 2
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        "Unknown member 'seqId'; accepted members: "
        "trainingSessionName, sequenceNumber, clientToken, operationConfig"
    )


def test_unknown_nested_member_names_where_it_is() -> None:
    request = optimizer_step()
    request["operationConfig"]["optimizerStep"]["adamParamsConfig"]["momentum"] = 0.9
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        "Unknown member 'momentum' at 'operationConfig.optimizerStep.adamParamsConfig'; "
        "accepted members: learningRate, beta1, beta2, eps, weightDecay, gradClipNorm, "
        "loraPlusLrRatio"
    )


def test_union_with_no_member_is_refused() -> None:
    request = optimizer_step()
    request["operationConfig"] = {}
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        "At 'operationConfig', exactly one of forward, forwardBackward, optimizerStep, "
        "saveWeights, saveState, loadState must be set; got none"
    )


def test_union_with_two_members_is_refused() -> None:
    request = optimizer_step()
    request["operationConfig"]["saveState"] = {}
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        "At 'operationConfig', exactly one of forward, forwardBackward, optimizerStep, "
        "saveWeights, saveState, loadState must be set; got 2: optimizerStep, saveState"
    )


@pytest.mark.parametrize(
    ("value", "shown", "constraint"),
    [
        ("1", "'1'", "Member must be an integer, not a string"),
        (True, "'true'", "Member must be an integer, not a boolean"),
        (1.5, "'1.5'", "Member must be an integer, not a decimal number"),
        (2.0, "'2.0'", "Member must be an integer, not a decimal number"),
    ],
)
def test_sequence_number_of_the_wrong_type_is_refused(
    value: object, shown: str, constraint: str
) -> None:
    request = optimizer_step()
    request["sequenceNumber"] = value
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        aws("sequenceNumber", constraint, shown)
    )


def test_list_where_a_structure_is_expected_is_refused() -> None:
    request = create_training_session()
    request["LoraConfig"] = [32, 64]
    assert refusal(CONTROL, "CreateTrainingSession", request) == one(
        aws("loraConfig", "Member must be an object, not a list", "'[32, 64]'")
    )


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_double_as_botocore_serialises_it_is_refused(text: str) -> None:
    request = optimizer_step()
    request["operationConfig"]["optimizerStep"]["adamParamsConfig"]["beta1"] = text
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        aws(
            "operationConfig.optimizerStep.adamParamsConfig.beta1",
            f"Member must be a finite number, not the string '{text}'",
            f"'{text}'",
        )
    )


def test_several_errors_are_counted_and_listed_in_one_message() -> None:
    request = sample()
    request["trainingSessionName"] = "a_b"
    request["operationConfig"]["sample"]["numSamples"] = 0
    request["operationConfig"]["sample"]["samplingParams"]["topP"] = 1.5
    message = refusal(RUNTIME, "ExecuteSamplingOperation", request)
    assert message == "3 validation errors detected: " + "; ".join(
        [
            aws(
                "trainingSessionName",
                "Member must satisfy regular expression pattern: [a-zA-Z0-9-]+",
                "'a_b'",
            ),
            aws(
                "operationConfig.sample.numSamples",
                "Member must have value greater than or equal to 1",
                "'0'",
            ),
            aws(
                "operationConfig.sample.samplingParams.topP",
                "Member must have value less than or equal to 1",
                "'1.5'",
            ),
        ]
    )


def test_past_the_cap_the_message_lists_the_first_ones_only() -> None:
    request = create_training_session()
    request["VpcConfig"]["SecurityGroupIds"] = ["sg_bad"] * 5
    request["VpcConfig"]["Subnets"] = ["subnet_bad"] * 16
    message = refusal(CONTROL, "CreateTrainingSession", request)
    assert message.startswith(
        f"More than {MAX_REPORTED} validation errors detected; the first {MAX_REPORTED}: "
    )
    assert message.count("failed to satisfy constraint") == MAX_REPORTED
    assert "at 'vpcConfig.securityGroupIds[0]'" in message


def test_token_of_the_wrong_type_is_named_by_its_path_without_echoing_the_datum() -> None:
    """A datum is a `sensitive` shape: like AWS, the message names the place, not the value."""
    request = forward_backward()
    datum = request["operationConfig"]["forwardBackward"]["datumList"][0]
    datum["modelInput"]["chunks"][0]["tokens"][1] = "two"
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        aws(
            "operationConfig.forwardBackward.datumList[0].modelInput.chunks[0].tokens[1]",
            "Member must be an integer, not a string",
        )
    )


def test_bad_token_at_the_end_of_a_long_list_is_found() -> None:
    request = forward_backward()
    chunk = request["operationConfig"]["forwardBackward"]["datumList"][0]["modelInput"]["chunks"][0]
    chunk["tokens"] = [*range(99_999), 2**31]
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        aws(
            "operationConfig.forwardBackward.datumList[0].modelInput.chunks[0].tokens[99999]",
            "Member must have value less than or equal to 2147483647",
        )
    )


@pytest.mark.parametrize(
    ("value", "constraint"),
    [
        (10**400, "Member must have value less than or equal to 0.01"),
        (float("inf"), "Member must be a finite number"),
    ],
)
def test_double_out_of_floats_range_is_refused_without_overflow(
    value: float, constraint: str
) -> None:
    request = optimizer_step()
    request["operationConfig"]["optimizerStep"]["adamParamsConfig"]["learningRate"] = value
    message = refusal(RUNTIME, "ExecuteTrainingOperation", request)
    assert message.endswith(
        "at 'operationConfig.optimizerStep.adamParamsConfig.learningRate' failed to satisfy "
        f"constraint: {constraint}"
    )


def test_null_list_item_in_a_request_is_refused() -> None:
    request = sample()
    request["operationConfig"]["sample"]["samplingParams"]["stop"] = ["\n", None]
    assert refusal(RUNTIME, "ExecuteSamplingOperation", request) == one(
        aws("operationConfig.sample.samplingParams.stop[1]", "Member must not be null", "null")
    )


def test_tensor_data_map_is_walked_to_its_values() -> None:
    request = forward_backward()
    datum = request["operationConfig"]["forwardBackward"]["datumList"][0]
    datum["lossFnInputs"]["weights"]["dtype"] = None
    datum["lossFnInputs"]["weights"]["data"] = "anything: a document is the caller's to check"
    assert refusal(RUNTIME, "ExecuteTrainingOperation", request) == one(
        aws(
            "operationConfig.forwardBackward.datumList[0].lossFnInputs[weights].dtype",
            "Member must not be null",
            "null",
        )
    )


def test_long_values_are_cut_short_in_the_message() -> None:
    request = create_training_session()
    request["TrainingSessionName"] = "n" * 10_000
    request["Tags"] = [{"Key": f"k{index}", "Value": "v"} for index in range(60)]
    message = refusal(CONTROL, "CreateTrainingSession", request)
    assert len(message) < 600
    assert "... (10000 characters)' at 'trainingSessionName'" in message
    assert "{Key=k4, Value=v}, ... (60 in all)]" in message
    assert "Member must have length less than or equal to 50" in message


def test_timestamp_that_is_neither_a_number_nor_iso_8601_is_refused() -> None:
    assert refusal(CONTROL, "ListTrainingSessions", {"CreationTimeAfter": "yesterday"}) == one(
        aws(
            "creationTimeAfter",
            "Member must be a timestamp (epoch seconds or an ISO 8601 string), not a string",
            "'yesterday'",
        )
    )


# -- Java's pattern dialect ----------------------------------------------------------------------


def test_unicode_letters_satisfy_the_tag_patterns() -> None:
    request = create_training_session()
    request["Tags"] = [
        {"Key": "Projekt Übersicht", "Value": "日本語 テスト"},
        {"Key": "équipe:ml/rl", "Value": "Ærø+1=2@ünï"},
    ]
    ServiceShapes.of(CONTROL).validate_input("CreateTrainingSession", request)


@pytest.mark.parametrize("key", ["<script>", "owner's", "tab\there"])
def test_tag_key_outside_its_classes_is_refused(key: str) -> None:
    request = create_training_session()
    request["Tags"] = [{"Key": key, "Value": "v"}]
    message = refusal(CONTROL, "CreateTrainingSession", request)
    assert message.startswith("1 validation error detected: Value '")
    assert message.endswith(
        "' at 'tags[0].key' failed to satisfy constraint: Member must satisfy regular "
        r"expression pattern: ([\p{L}\p{Z}\p{N}_.:/=+\-@]*)"
    )


def test_entity_description_takes_letters_marks_symbols_and_punctuation() -> None:
    params = {
        "ModelPackageGroupName": "gsm8k-grpo",
        "ModelPackageGroupDescription": "Checkpoints für 日本 — GRPO (v2), 100% ✓ café!",
    }
    ServiceShapes.of(CONTROL).validate_input("CreateModelPackageGroup", params)


def test_entity_description_refuses_a_control_character_and_shows_it_escaped() -> None:
    params = {"ModelPackageGroupName": "g", "ModelPackageGroupDescription": "bell\x07"}
    assert refusal(CONTROL, "CreateModelPackageGroup", params) == one(
        aws(
            "modelPackageGroupDescription",
            r"Member must satisfy regular expression pattern: [\p{L}\p{M}\p{Z}\p{S}\p{N}\p{P}]*",
            r"'bell\x07'",
        )
    )


def test_digits_in_a_pattern_are_ascii_as_in_java() -> None:
    request = create_training_session()
    request["RoleArn"] = "arn:aws:iam::１２３４５６７８９０１２:role/r"  # fullwidth digits
    assert "at 'roleArn' failed to satisfy constraint: Member must satisfy regular" in refusal(
        CONTROL, "CreateTrainingSession", request
    )


# -- responses ------------------------------------------------------------------------------------


def forward_backward_result() -> dict[str, Any]:
    return {
        "status": "Completed",
        "operationResult": {
            "forwardBackward": {
                "metrics": {"loss:sum": 1.25, "global_token_num": 4},
                "lossFnOutputs": [
                    {"logprobs": {"data": [-0.5, -0.25, -1.0, -2.0], "dtype": "float32"}}
                ],
                "lossFnOutputType": "ppo",
                "tokenUsage": {"trainingTokens": 4},
            }
        },
        "tokenUsage": {"trainingTokens": 4},
    }


def test_well_formed_forward_backward_result_passes() -> None:
    ServiceShapes.of(RUNTIME).validate_output(
        "GetTrainingOperationResult", forward_backward_result()
    )


def test_result_with_an_empty_operation_result_union_is_refused() -> None:
    result = forward_backward_result()
    result["operationResult"] = {}
    assert output_refusal(RUNTIME, "GetTrainingOperationResult", result) == one(
        "At 'operationResult', exactly one of forward, forwardBackward, optimizerStep, "
        "saveWeights, saveState, loadState must be set; got none"
    )


def test_result_with_a_null_metric_is_refused() -> None:
    result = forward_backward_result()
    result["operationResult"]["forwardBackward"]["metrics"]["loss:sum"] = None
    assert output_refusal(RUNTIME, "GetTrainingOperationResult", result) == one(
        aws(
            "operationResult.forwardBackward.metrics[loss:sum]",
            "Member must not be null",
            "null",
        )
    )


def test_result_with_an_unknown_status_is_refused() -> None:
    result = forward_backward_result()
    result["status"] = "Done"
    assert output_refusal(RUNTIME, "GetTrainingOperationResult", result) == one(
        aws(
            "status",
            "Member must satisfy enum value set: [Pending, InProgress, Completed, Failed, Skipped]",
            "'Done'",
        )
    )


def test_compute_logprobs_result_may_start_with_null() -> None:
    """botocore reads lists as sparse; the first prompt token has no log-probability."""
    result = {
        "status": "Completed",
        "operationResult": {"computeLogprobs": {"logprobs": [None, -1.5]}},
    }
    ServiceShapes.of(RUNTIME).validate_output("GetSamplingOperationResult", result)


def test_describe_training_session_response_passes() -> None:
    detail = {
        "TrainingSessionArn": SESSION_ARN,
        "TrainingSessionName": "gsm8k-grpo-demo",
        "TrainingSessionStatus": "Running",
        "CreationTime": 1767225600.25,
        "LastReceivedSequenceNumber": 9,
        "LoraConfig": {"Rank": 32, "Alpha": 64},
    }
    ServiceShapes.of(CONTROL).validate_output(
        "DescribeTrainingSession", {"TrainingSessionDetail": detail}
    )


def test_operation_without_output_takes_only_an_empty_object() -> None:
    ServiceShapes.of(CONTROL).validate_output("DeleteModelPackage", {})
    assert output_refusal(CONTROL, "DeleteModelPackage", {"x": 1}) == one(
        "Expected an empty object, got '{x=1}'"
    )


# -- loading --------------------------------------------------------------------------------------


def test_models_are_loaded_once_per_process() -> None:
    assert ServiceShapes.of(CONTROL) is ServiceShapes.of(CONTROL)
    assert ServiceShapes.of(RUNTIME) is ServiceShapes.of(RUNTIME)
    assert ServiceShapes.of(RUNTIME).has_operation("ExecuteTrainingOperation")
    assert not ServiceShapes.of(CONTROL).has_operation("ExecuteTrainingOperation")


@pytest.mark.parametrize(
    ("service", "operation", "request_of"),
    [
        (CONTROL, "CreateTrainingSession", create_training_session),
        (RUNTIME, "ExecuteTrainingOperation", forward_backward),
    ],
)
def test_first_load_time_is_reported(
    service: str, operation: str, request_of: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `of()` does on its first call, timed with a fresh loader (no assertion on time)."""
    started = time.perf_counter()
    data = create_loader().load_service_model(service, "service-2")
    shapes = ServiceShapes(ServiceModel(data, service_name=service))
    loaded = time.perf_counter()
    shapes.validate_input(operation, request_of())
    walked = time.perf_counter()
    with capsys.disabled():
        print(
            f"\n{service}: model loaded in {(loaded - started) * 1000:.1f} ms; "
            f"first {operation} validated in {(walked - loaded) * 1000:.1f} ms"
        )
