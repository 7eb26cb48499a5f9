"""The typed results store exactly the JSON the worker stored before them, and read it back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from treadle.platform.eventlog import results
from treadle.platform.eventlog.optypes import OpType, Tensor

SEQUENCE = {"tokens": [5, 6], "logprobs": [-0.5, -1.25], "stop_reason": "length"}
# One stored result per operation type, as the worker wrote them before the types (key order too).
STORED: dict[OpType, dict[str, Any]] = {
    OpType.CREATE_MODEL: {"model_id": "m1"},
    OpType.LOAD_WEIGHTS: {"model_id": "m1", "path": "tinker://m0/weights/a"},
    OpType.REBUILD: {"model_id": "m2", "report": {"matched": True, "replayed": 3, "steps": [1]}},
    OpType.FORWARD_BACKWARD: {
        "loss_fn_outputs": [
            {
                "logprobs": {"dtype": "float32", "shape": [3], "data": [-1.0, -2.5, -0.125]},
                "elementwise_loss": {"dtype": "float32", "shape": [3], "data": [1.0, 2.5, 0.0]},
            },
            {"logprobs": {"dtype": "float32", "shape": [0], "data": []}},
        ],
        "metrics": {"loss:sum": 3.625},
    },
    OpType.OPTIM_STEP: {"metrics": {"grad_norm:mean": 0.5, "learning_rate:mean": 0.0001}},
    OpType.SAVE_WEIGHTS: {"path": "tinker://m1/weights/a"},
    OpType.SAVE_WEIGHTS_FOR_SAMPLER: {"sampling_session_id": "s1", "snapshot_id": "m1#inflight"},
    OpType.SAMPLE: {
        "sequences": [SEQUENCE],
        "prompt_logprobs": None,
        "topk_prompt_logprobs": None,
    },
    OpType.LOAD_SAMPLER_WEIGHTS: {"snapshot_id": "sn1"},
}
# A sample with every optional part asked for, and a save whose registration added its version.
FULL_SAMPLE = {
    "sequences": [
        SEQUENCE | {"topk_logprobs": [[[5, -0.5], [9, -1.0]], [[6, -1.25], [2, -2.0]]]},
        {"tokens": [7], "logprobs": [-0.75], "stop_reason": "stop"} | {"topk_logprobs": [[]]},
    ],
    "prompt_logprobs": [None, -1.5, -0.25],
    "topk_prompt_logprobs": [[], [[3, -1.5]], [[4, -0.25]]],
    "target_prompt_logprobs": {
        "rows": 2,
        "k": 3,
        "crow_indices": [0, 0, 1],
        "col_indices": [2],
        "values": [-3.0],
    },
    "prompt_alt_tokens": {"k": 1, "tokens": [[8], [9]], "logprobs": [[-0.5], [-1.0]]},
}
DENSE_TARGETS = {
    "rows": 1,
    "k": 2,
    "crow_indices": None,
    "col_indices": None,
    "values": [-1.0, 0.0],
}
REGISTERED_SAVE = {"path": "tinker://m1/weights/a", "model_package_group": "g", "version": 2}


def _same_json(result: results.Result, stored: dict[str, Any]) -> None:
    """Stored as the same JSON text, key order included (the notice is encoded from it)."""
    assert json.dumps(result.to_json()) == json.dumps(stored)


@pytest.mark.parametrize("op_type", list(OpType))
def test_each_stored_result_reads_back_and_stores_the_same_json(op_type: OpType) -> None:
    result = results.read(op_type, STORED[op_type])
    assert type(result) is results.RESULTS[op_type] and op_type == result.TYPE
    _same_json(result, STORED[op_type])


def test_every_operation_type_has_a_result_type() -> None:
    assert set(results.RESULTS) == set(OpType)


def test_a_sample_with_every_part_asked_for_stores_each_part() -> None:
    result = results.SampleOutput.model_validate(FULL_SAMPLE)
    assert result.sequences[0].topk_logprobs == [[(5, -0.5), (9, -1.0)], [(6, -1.25), (2, -2.0)]]
    assert result.target_prompt_logprobs is not None
    assert result.target_prompt_logprobs.values == [-3.0]
    assert result.prompt_alt_tokens is not None and result.prompt_alt_tokens.k == 1
    _same_json(result, FULL_SAMPLE)


def test_parts_not_asked_for_leave_their_keys_out_rather_than_null() -> None:
    sequence = results.SampledSequence(tokens=[1], logprobs=[-1.0], stop_reason="stop")
    result = results.SampleOutput(sequences=[sequence])
    assert result.to_json() == {
        "sequences": [{"tokens": [1], "logprobs": [-1.0], "stop_reason": "stop"}],
        "prompt_logprobs": None,  # always stored, null when not asked for
        "topk_prompt_logprobs": None,
    }


def test_dense_target_logprobs_keep_null_row_pointers() -> None:
    stored = {**STORED[OpType.SAMPLE], "target_prompt_logprobs": DENSE_TARGETS}
    _same_json(results.SampleOutput.model_validate(stored), stored)


def test_a_registered_save_stores_its_version_and_an_unregistered_one_leaves_it_out() -> None:
    registered = results.SaveWeightsOutput.model_validate(REGISTERED_SAVE)
    assert (registered.model_package_group, registered.version) == ("g", 2)
    _same_json(registered, REGISTERED_SAVE)
    assert results.SaveWeightsOutput(path="tinker://m1/weights/a").to_json() == {
        "path": "tinker://m1/weights/a"
    }


def test_a_forward_backward_stores_its_pass_budget_and_an_older_result_reads_without_it() -> None:
    """The budget a forward_backward ran with is stored (replay runs it again with it); a result
    written before it was recorded reads back with none and stores the same JSON."""
    older = STORED[OpType.FORWARD_BACKWARD]
    assert results.ForwardBackwardOutput.model_validate(older).pass_tokens is None
    recorded = {**older, "pass_tokens": 682}
    typed = results.ForwardBackwardOutput.model_validate(recorded)
    assert typed.pass_tokens == 682
    _same_json(typed, recorded)


def test_numbers_are_stored_as_given() -> None:
    """Tensor data keeps ints as ints and floats as floats; -0.0 stays -0.0."""
    outputs = [{"ids": Tensor(dtype="int64", shape=[2], data=[3, 4]),
                "logprobs": Tensor(dtype="float32", shape=[2], data=[-0.0, -1.0])}]  # fmt: skip
    result = results.ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": 1.0})
    assert json.dumps(result.to_json()["loss_fn_outputs"]) == (
        '[{"ids": {"dtype": "int64", "shape": [2], "data": [3, 4]}, '
        '"logprobs": {"dtype": "float32", "shape": [2], "data": [-0.0, -1.0]}}]'
    )


def test_a_stored_result_that_does_not_fit_its_type_is_named() -> None:
    with pytest.raises(ValueError, match="a stored sample result does not fit its type"):
        results.read("sample", {"sequences": [{"tokens": [1]}]})
    with pytest.raises(ValueError, match="forward_backward"):
        results.read("forward_backward", {"metrics": {}, "loss_fn_outputs": [], "extra": 1})


def test_results_are_frozen() -> None:
    result = results.read(OpType.OPTIM_STEP, STORED[OpType.OPTIM_STEP])
    with pytest.raises(ValueError, match="frozen"):
        result.metrics = {}  # type: ignore[misc]
