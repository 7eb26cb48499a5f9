"""The new sample result fields on the wire: what the worker stores becomes a SampleResponse the
tinker SDK's own decoder reads back as the values and layouts the request asked for."""

from __future__ import annotations

import numpy as np
import pytest
from tinker.proto.response_conv import deserialize_sample_response

from treadle.api.tinker.wire import _Budget, _datum, encode_sample_response
from treadle.platform.errors import ValidationError

SEQUENCE = {"tokens": [5, 6], "logprobs": [-0.5, -1.5], "stop_reason": "length"}


def test_topk_sampled_logprobs_come_back_per_sequence() -> None:
    rows = [[[5, -0.5], [9, -1.0]], [[7, -0.25], [6, -1.5]]]
    response = deserialize_sample_response(
        encode_sample_response(
            {"sequences": [SEQUENCE | {"topk_logprobs": rows}, SEQUENCE], "prompt_logprobs": None}
        )
    )
    assert response.sequences[0].topk_logprobs == [[(5, -0.5), (9, -1.0)], [(7, -0.25), (6, -1.5)]]
    assert response.sequences[1].topk_logprobs is None  # not asked for, not sent


def test_dense_target_logprobs_keep_their_shape() -> None:
    values = [-1.0, 0.0, -2.5, -3.0, -0.5, 0.0]
    stored = {"rows": 3, "k": 2, "crow_indices": None, "col_indices": None, "values": values}
    response = deserialize_sample_response(
        encode_sample_response(
            {"sequences": [SEQUENCE], "prompt_logprobs": None, "target_prompt_logprobs": stored}
        )
    )
    target = response.target_prompt_logprobs
    assert target is not None and target.dtype == "float32" and target.shape == [3, 2]
    np.testing.assert_array_equal(target.to_numpy(), np.reshape(values, (3, 2)))


def test_sparse_target_logprobs_keep_their_csr_layout() -> None:
    stored = {
        "rows": 3,
        "k": 4,
        "crow_indices": [0, 0, 2, 3],
        "col_indices": [1, 3, 0],
        "values": [-1.25, -2.0, 0.0],
    }
    response = deserialize_sample_response(
        encode_sample_response(
            {"sequences": [SEQUENCE], "prompt_logprobs": None, "target_prompt_logprobs": stored}
        )
    )
    target = response.target_prompt_logprobs
    assert target is not None and target.shape == [3, 4]
    assert target.sparse_crow_indices == [0, 0, 2, 3]
    assert target.sparse_col_indices == [1, 3, 0]
    assert list(target.data) == [-1.25, -2.0, 0.0]
    dense = np.zeros((3, 4), np.float32)
    dense[1, 1], dense[1, 3], dense[2, 0] = -1.25, -2.0, 0.0
    np.testing.assert_array_equal(target.to_numpy(), dense)


def test_prompt_alt_tokens_are_two_tables() -> None:
    alt = {"k": 2, "tokens": [[3, 4], [5, 5]], "logprobs": [[-0.5, -1.0], [-2.0, -2.0]]}
    response = deserialize_sample_response(
        encode_sample_response(
            {"sequences": [SEQUENCE], "prompt_logprobs": None, "prompt_alt_tokens": alt}
        )
    )
    assert response.prompt_alt_tokens is not None
    tokens, logprobs = response.prompt_alt_tokens.tokens, response.prompt_alt_tokens.logprobs
    assert tokens.dtype == "int64" and tokens.shape == [2, 2]
    assert tokens.to_numpy().tolist() == [[3, 4], [5, 5]]
    assert logprobs.to_numpy().tolist() == [[-0.5, -1.0], [-2.0, -2.0]]


def test_last_n_prompt_logprobs_are_nan_before_the_tail() -> None:
    stored = {
        "sequences": [SEQUENCE],
        "prompt_logprobs": [None, None, -1.0, -2.0],
        "topk_prompt_logprobs": [[], [], [[3, -1.0]], [[4, -2.0]]],
    }
    response = deserialize_sample_response(encode_sample_response(stored))
    assert response.prompt_logprobs == [None, None, -1.0, -2.0]
    assert response.topk_prompt_logprobs == [None, None, [(3, -1.0)], [(4, -2.0)]]


def test_a_datums_provenance_spans_are_read_in_order() -> None:
    from tinker.proto import tinker_public_pb2 as pb

    datum = pb.Datum(
        model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=b"\x01\x00\x00\x00"))],
        model_input_spans=[
            pb.ProvenanceSpan(prompt_tokens=pb.PromptProvenanceSpan(sequence_id="r:0", length=1))
        ],
        loss_fn_input_spans=[
            pb.ProvenanceSpan(
                sampled_tokens=pb.SampledProvenanceSpan(sequence_id="r:0", offset=2, length=1)
            )
        ],
    )
    assert _datum(0, datum, _Budget(1000))["provenance"] == {
        "model_input": [{"kind": "prompt", "sequence_id": "r:0", "offset": 0, "length": 1}],
        "targets": [{"kind": "sampled", "sequence_id": "r:0", "offset": 2, "length": 1}],
    }


@pytest.mark.parametrize(
    ("span", "says"),
    [
        ({}, "entry is empty"),
        ({"prompt_tokens": {"sequence_id": "", "length": 1}}, "no valid sequence_id"),
        ({"sampled_tokens": {"sequence_id": "r:0", "length": -1}}, "may be negative"),
    ],
)
def test_a_malformed_provenance_span_is_refused_by_name(span: dict, says: str) -> None:
    from tinker.proto import tinker_public_pb2 as pb

    datum = pb.Datum(model_input_spans=[pb.ProvenanceSpan(**span)])
    with pytest.raises(ValidationError, match=f"datum 0: .*{says}"):
        _datum(0, datum, _Budget(1000))


def test_a_sample_payload_with_every_option_round_trips_through_the_log() -> None:
    from treadle.platform.eventlog import optypes

    payload = optypes.Sample(
        prompt=[1, 2, 3],
        snapshot_id="s",
        checkpoint_prefix=None,
        num_samples=2,
        prompt_logprobs=True,
        topk_prompt_logprobs=2,
        params=optypes.SamplingParams(max_tokens=4, seed=3),
        prompt_logprobs_last_n=1,
        target_prompt_logprobs=optypes.PromptTargets(
            rows=2, k=3, ids=[7], crow_indices=[0, 0, 1], col_indices=[2]
        ),
        prompt_alt_tokens_k=4,
        topk_sample_logprobs=5,
    )
    assert optypes.parse_payload("sample", payload.to_json()) == payload
