"""The protobuf codec against the tinker SDK's own encoder and decoders."""

from __future__ import annotations

import pytest
from tinker import types
from tinker.proto import response_conv
from tinker.proto.request_conv import forward_backward_request_to_proto

from treadle.api.tinker import wire
from treadle.platform.errors import ValidationError


def _request(**config: float) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 0.5]},
    )
    request = types.ForwardBackwardRequest(
        model_id="m",
        seq_id=7,
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config=config or None
        ),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_sdk_request_decodes_to_plain_payload() -> None:
    decoded = wire.decode_forward_backward(_request(clip_low_threshold=0.8))
    assert decoded["model_id"] == "m" and decoded["seq_id"] == 7
    payload = decoded["payload"]
    assert payload["loss_fn"] == "ppo" and payload["loss_fn_config"] == {"clip_low_threshold": 0.8}
    datum = payload["data"][0]
    assert datum["tokens"] == [1, 2, 3]
    assert datum["loss_fn_inputs"]["target_tokens"] == {
        "dtype": "int64",
        "shape": [3],
        "data": [2, 3, 4],
    }
    assert datum["loss_fn_inputs"]["weights"]["data"] == [0.0, 1.0, 0.5]


def test_garbage_body_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="protobuf"):
        wire.decode_forward_backward(b"\xff\xff\xff\xff")


def test_forward_backward_output_round_trips_through_the_sdk_decoder() -> None:
    result = {
        "loss_fn_outputs": [
            {"logprobs": {"dtype": "float32", "shape": [3], "data": [-1.0, -2.0, -0.5]}},
            {"logprobs": {"dtype": "float32", "shape": [1], "data": [-3.25]}},
        ],
        "metrics": {"loss:sum": 6.75},
    }
    out = response_conv.deserialize_forward_backward_output(
        wire.encode_forward_backward_output(result)
    )
    assert out.metrics == {"loss:sum": 6.75}
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0, -2.0, -0.5]
    assert out.loss_fn_outputs[1]["logprobs"].tolist() == [-3.25]


def test_sample_response_round_trips_with_prompt_logprobs() -> None:
    result = {
        "sequences": [{"tokens": [5, 6], "logprobs": [-0.5, -0.25], "stop_reason": "length"}],
        "prompt_logprobs": [None, -1.5],
    }
    out = response_conv.deserialize_sample_response(wire.encode_sample_response(result))
    assert out.sequences[0].tokens == [5, 6]
    assert out.sequences[0].logprobs == [-0.5, -0.25]
    assert out.sequences[0].stop_reason == "length"
    assert out.prompt_logprobs[0] is None  # NaN on the wire means "not computed"
    assert out.prompt_logprobs[1] == -1.5


def test_topk_prompt_logprobs_pad_missing_slots() -> None:
    result = {
        "sequences": [{"tokens": [5], "logprobs": [-0.5], "stop_reason": "stop"}],
        "prompt_logprobs": [None, -1.0],
        "topk_prompt_logprobs": [[], [[7, -0.25], [3, -1.0]]],
    }
    out = response_conv.deserialize_sample_response(wire.encode_sample_response(result))
    assert out.topk_prompt_logprobs[0] in (None, [])
    assert out.topk_prompt_logprobs[1] == [(7, -0.25), (3, -1.0)]
