"""The runtime's operations as Treadle's payloads, and their results as the runtime's answers
(api/sagemaker/convert.py), checked against botocore's own service model where it has a word."""

from __future__ import annotations

from typing import Any

import pytest

from treadle.api.sagemaker import convert
from treadle.api.sagemaker.shapes import ServiceShapes
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import optypes
from treadle.platform.models import catalog, validation
from treadle.platform.sagemaker.runtime_ops import Kind
from treadle.platform.sessions.sessions import SessionRow

MODEL = catalog.get_base_model(catalog.TINY_DEBUG_NAME)
RUNTIME = ServiceShapes.of("sagemakertrainingsessionruntime")
SESSION = SessionRow(
    id="sess-0123456789abcdef:train:0",
    tenant_id="acme",
    client_session_id="sess-0123456789abcdef",
    kind="training",
    name="demo",
    base_model=MODEL.name,
    lora_config={"rank": 8, "alpha": 16.0, "seed": 0},
    status="Running",
    worker_id="w",
    lease_epoch=1,
    last_applied_seq=0,
)


def tensor(data: list[Any], dtype: str = "float32") -> dict[str, Any]:
    return {"data": data, "dtype": dtype}


def ppo_datum(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The wire form the SageMaker SDK sends for the example's datum: every TensorData built
    without a dtype goes out as float32, token ids included."""
    tokens = [5, 6, 7, 8]
    return {
        "modelInput": {
            "chunks": [
                {"tokens": tokens[:2], "type": "encoded_text"},
                {"tokens": tokens[2:], "type": "encoded_text"},
            ]
        },  # fmt: skip
        "lossFnInputs": {
            "target_tokens": tensor([6, 7, 8, 9]),
            "weights": tensor([0.0, 0.0, 1.0, 1.0]),
            "logprobs": tensor([0.0, 0.0, -1.5, -2.0]),
            "advantages": tensor([0.0, 0.0, 0.5, 0.5]),
            **(extra or {}),
        },
    }


def fb_config(*datums: dict[str, Any], loss: str = "ppo") -> dict[str, Any]:
    return {"lossFnName": loss, "datumList": list(datums)}


def test_the_examples_ppo_datum_becomes_a_forward_backward() -> None:
    payload = convert.training_payload(
        Kind.FORWARD_BACKWARD, fb_config(ppo_datum()), SESSION, MODEL, 1
    )
    assert isinstance(payload, optypes.ForwardBackward)
    assert not payload.forward_only
    (datum,) = payload.data
    assert datum.tokens == [5, 6, 7, 8]  # the chunks, joined
    targets = datum.loss_fn_inputs["target_tokens"]
    assert (targets.dtype, targets.data) == ("int64", [6, 7, 8, 9])
    assert datum.loss_fn_inputs["weights"].data == [0.0, 0.0, 1.0, 1.0]
    assert payload.loss_fn_config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def test_forward_is_a_forward_only_pass() -> None:
    payload = convert.training_payload(Kind.FORWARD, fb_config(ppo_datum()), SESSION, MODEL, 2)
    assert isinstance(payload, optypes.ForwardBackward) and payload.forward_only


@pytest.mark.parametrize("key", ["ref_log_prob", "temperature"])
def test_listed_inputs_the_server_does_not_compute_are_refused_by_name(key: str) -> None:
    datum = ppo_datum({key: tensor([1.0, 1.0, 1.0, 1.0])})
    with pytest.raises(ValidationError, match=rf"lossFnInputs\['{key}'\]"):
        convert.training_payload(Kind.FORWARD_BACKWARD, fb_config(datum), SESSION, MODEL, 1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"old_logprobs": tensor([0.0] * 4)}, "accepted keys are"),
        ({"target_tokens": tensor([6, 7.5, 8, 9])}, "whole-number token id"),
        ({"weights": tensor([1, 1, 1], "float32")}, "model_input has 4 tokens"),
        ({"weights": {**tensor([1.0] * 4), "shape": [2, 2]}}, "flat"),
        ({"weights": tensor([1.0] * 4, "float64")}, "dtype is 'float64'"),
        ({"weights": tensor([1.0, "x", 1.0, 1.0])}, "finite number"),
    ],
)
def test_malformed_datums_are_refused_with_where_and_why(extra: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        convert.training_payload(
            Kind.FORWARD_BACKWARD, fb_config(ppo_datum(extra)), SESSION, MODEL, 1
        )


def test_loss_config_keys_are_the_losses_own() -> None:
    config = {**fb_config(ppo_datum()), "lossFnConfig": {"clip_low_threshold": 0.5}}
    payload = convert.training_payload(Kind.FORWARD_BACKWARD, config, SESSION, MODEL, 1)
    assert isinstance(payload, optypes.ForwardBackward)
    assert payload.loss_fn_config["clip_low_threshold"] == 0.5
    config["lossFnConfig"] = {"beta": 0.1}
    with pytest.raises(ValidationError, match="unknown keys"):
        convert.training_payload(Kind.FORWARD_BACKWARD, config, SESSION, MODEL, 1)


def test_optimizer_step_takes_sagemakers_defaults_and_lora_plus() -> None:
    config = {"adamParamsConfig": {"learningRate": 1e-5, "loraPlusLrRatio": 16.0}}
    payload = convert.training_payload(Kind.OPTIMIZER_STEP, config, SESSION, MODEL, 3)
    assert payload == optypes.OptimStep(
        learning_rate=1e-5,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        grad_clip_norm=0.0,
        lora_plus_lr_ratio=16.0,
    )


def test_saves_are_named_by_their_sequence_number() -> None:
    state = convert.training_payload(Kind.SAVE_STATE, {"description": "d"}, SESSION, MODEL, 9)
    weights = convert.training_payload(
        Kind.SAVE_WEIGHTS, {"mergeWeights": True}, SESSION, MODEL, 10
    )
    assert isinstance(state, optypes.SaveWeights) and isinstance(weights, optypes.SaveWeights)
    assert state.path == f"tinker://{SESSION.id}/weights/state-000009"
    assert state.with_optimizer and not state.merge_weights and state.description == "d"
    assert weights.path == f"tinker://{SESSION.id}/sampler_weights/weights-000010"
    assert weights.merge_weights and not weights.with_optimizer
    assert state.prefix.startswith("tenants/acme/sessions/")


def sample_config(**params: Any) -> dict[str, Any]:
    return {
        "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
        "numSamples": 2,
        "samplingParams": {"maxTokens": 512, **params},
    }


def test_a_sample_keeps_its_parameters() -> None:
    payload = convert.sample(
        {
            **sample_config(temperature=0.7, topP=0.9, seed=7, stop=["\n"]),
            "includePromptLogprobs": True,
        },  # fmt: skip
        MODEL,
        snapshot_id="checkpoint:x",
        checkpoint_prefix="p",
    )
    assert payload.prompt == [1, 2, 3] and payload.num_samples == 2 and payload.prompt_logprobs
    assert payload.params == optypes.SamplingParams(
        max_tokens=512, temperature=0.7, top_p=0.9, seed=7, stop=["\n"]
    )
    assert (payload.snapshot_id, payload.checkpoint_prefix) == ("checkpoint:x", "p")


def test_top_p_zero_keeps_only_the_likeliest_token() -> None:
    payload = convert.sample(sample_config(topP=0.0), MODEL, snapshot_id=None,
                             checkpoint_prefix=None)  # fmt: skip
    assert payload.params.top_p == validation.MIN_TOP_P


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": 1e-4}, "use 0 for greedy"),
        ({"seed": -1}, "seed is -1"),
        ({"topK": -2}, "topK is -2"),
        ({"maxTokens": 4096}, "exceeds the context"),
    ],
)
def test_sampling_parameters_treadle_cannot_honour_are_refused(params: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        convert.sample(sample_config(**params), MODEL, snapshot_id=None, checkpoint_prefix=None)


def test_more_samples_than_one_operation_takes_are_refused() -> None:
    config = {**sample_config(), "numSamples": validation.MAX_NUM_SAMPLES + 1}
    with pytest.raises(ValidationError, match="several operations"):
        convert.sample(config, MODEL, snapshot_id=None, checkpoint_prefix=None)


def test_compute_logprobs_is_the_tinker_sdks_one_token_sample() -> None:
    payload = convert.compute_logprobs(
        sample_config(), MODEL, snapshot_id=None, checkpoint_prefix=None
    )
    assert payload.num_samples == 1 and payload.prompt_logprobs
    assert payload.params == optypes.SamplingParams(max_tokens=1)


# --- results, checked against the service model ------------------------------------------


def answered(operation: str, result: dict[str, Any]) -> None:
    RUNTIME.validate_output(operation, {"status": "Completed", "operationResult": result})


def test_a_forward_backward_result_is_what_botocore_parses() -> None:
    result = {
        "loss_fn_outputs": [{"logprobs": {"dtype": "float32", "shape": [2], "data": [-1.0, -2]}}],
        "metrics": {"loss:sum": 3.0},
    }
    answer = convert.training_result(Kind.FORWARD_BACKWARD, result, None)
    answered("GetTrainingOperationResult", answer)
    assert answer["forwardBackward"]["lossFnOutputs"][0]["logprobs"]["data"] == [-1.0, -2]


def test_save_and_load_results_are_union_members() -> None:
    arn = "arn:aws:sagemaker:us-west-2:123456789012:model-package/g/1"
    for kind in (Kind.SAVE_WEIGHTS, Kind.SAVE_STATE):
        answered("GetTrainingOperationResult", convert.training_result(kind, {}, arn))
    answer = convert.training_result(Kind.LOAD_STATE, {}, None)
    assert answer == {"loadState": {}}
    answered("GetTrainingOperationResult", answer)


def sample_result(prompt_logprobs: Any = None, topk: Any = None) -> dict[str, Any]:
    return {
        "sequences": [{"tokens": [4, 5], "logprobs": [-0.5, -0.25], "stop_reason": "stop"}],
        "prompt_logprobs": prompt_logprobs,
        "topk_prompt_logprobs": topk,
    }


def test_prompt_logprobs_leave_out_the_first_token_which_has_none() -> None:
    answer = convert.sampling_result(
        Kind.SAMPLE,
        sample_result([None, -1.0, -2.0], [[], [[7, -0.1]], [[8, -0.2], [9, -0.3]]]),
    )
    answered("GetSamplingOperationResult", answer)
    sample = answer["sample"]
    assert sample["promptLogprobs"] == [-1.0, -2.0]
    assert sample["topkPromptLogprobs"][1] == [
        {"tokenId": 8, "logprob": -0.2},
        {"tokenId": 9, "logprob": -0.3},
    ]
    assert sample["sequences"] == [{"stopReason": "stop", "tokens": [4, 5],
                                    "logprobs": [-0.5, -0.25]}]  # fmt: skip


def test_compute_logprobs_keeps_one_entry_per_prompt_token() -> None:
    answer = convert.sampling_result(Kind.COMPUTE_LOGPROBS, sample_result([None, -1.0, -2.0]))
    answered("GetSamplingOperationResult", answer)
    assert answer == {"computeLogprobs": {"logprobs": [None, -1.0, -2.0]}}
