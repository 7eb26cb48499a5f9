"""The handlers' typed results store exactly the JSON they stored as dictionaries: the same keys,
the same values, and no key for a part the request did not ask for."""

from __future__ import annotations

import json

import numpy as np

from treadle.engine import SampledSequence, SampleResult
from treadle.platform.eventlog import optypes
from treadle.worker import handlers


def _sample(**options: object) -> optypes.Sample:
    return optypes.Sample.model_validate(
        {
            "prompt": [1, 2, 3],
            "snapshot_id": "s",
            "checkpoint_prefix": None,
            "num_samples": 1,
            "prompt_logprobs": False,
            "params": {"max_tokens": 2},
        }
        | options
    )


def _stored(outcome: handlers.Outcome) -> str:
    return json.dumps(outcome.result.to_json())


def test_a_plain_sample_stores_no_optional_keys() -> None:
    out = SampleResult(
        sequences=[SampledSequence(tokens=[4, 5], logprobs=[-0.5, -0.25], stop_reason="length")],
        prompt_logprobs=None,
        prefill_tokens=3,
        sample_tokens=2,
    )
    outcome = handlers.sample_outcome(_sample(), out)
    assert _stored(outcome) == json.dumps(
        {
            "sequences": [{"tokens": [4, 5], "logprobs": [-0.5, -0.25], "stop_reason": "length"}],
            "prompt_logprobs": None,
            "topk_prompt_logprobs": None,
        }
    )
    assert outcome.tokens == {"prefill": 3, "sample": 2, "train": 0}


def test_a_sample_with_every_part_stores_each_in_the_requests_layout() -> None:
    targets = optypes.PromptTargets(rows=2, k=2, ids=[7], crow_indices=[0, 0, 1], col_indices=[1])
    payload = _sample(
        prompt_logprobs=True,
        topk_prompt_logprobs=1,
        target_prompt_logprobs=targets,
        prompt_alt_tokens_k=1,
        topk_sample_logprobs=1,
    )
    out = SampleResult(
        sequences=[
            SampledSequence(
                tokens=[4], logprobs=[-0.5], stop_reason="stop", topk_logprobs=[[(4, -0.5)]]
            )
        ],
        prompt_logprobs=[None, -1.0, -2.0],
        prefill_tokens=3,
        sample_tokens=1,
        topk_prompt_logprobs=[[], [(2, -1.0)], [(3, -2.0)]],
        target_prompt_logprobs=[-4.0],
        prompt_alt_tokens=[[9], [8]],
        prompt_alt_logprobs=[[-0.1], [-0.2]],
    )
    assert _stored(handlers.sample_outcome(payload, out)) == json.dumps(
        {
            "sequences": [
                {
                    "tokens": [4],
                    "logprobs": [-0.5],
                    "stop_reason": "stop",
                    "topk_logprobs": [[[4, -0.5]]],
                }  # fmt: skip
            ],
            "prompt_logprobs": [None, -1.0, -2.0],
            "topk_prompt_logprobs": [[], [[2, -1.0]], [[3, -2.0]]],
            "target_prompt_logprobs": {
                "rows": 2,
                "k": 2,
                "crow_indices": [0, 0, 1],
                "col_indices": [1],
                "values": [-4.0],
            },  # fmt: skip
            "prompt_alt_tokens": {"k": 1, "tokens": [[9], [8]], "logprobs": [[-0.1], [-0.2]]},
        }
    )


def test_dense_targets_store_null_row_pointers() -> None:
    payload = _sample(target_prompt_logprobs=optypes.PromptTargets(rows=1, k=2, ids=[7, -1]))
    out = SampleResult(
        sequences=[],
        prompt_logprobs=None,
        prefill_tokens=3,
        sample_tokens=0,
        target_prompt_logprobs=[-4.0, 0.0],
    )
    stored = handlers.sample_outcome(payload, out).result.to_json()
    assert stored["target_prompt_logprobs"] == {
        "rows": 1, "k": 2, "crow_indices": None, "col_indices": None, "values": [-4.0, 0.0]
    }  # fmt: skip


def test_a_forward_backward_output_stores_each_array_flat_with_its_shape() -> None:
    tensor = handlers._tensor(np.array([[1, 2], [3, 4]], dtype=np.int64))
    assert tensor.model_dump() == {"dtype": "int64", "shape": [2, 2], "data": [1, 2, 3, 4]}
    floats = handlers._tensor(np.array([-0.5, -1.0], dtype=np.float32))
    assert json.dumps(floats.model_dump()) == (
        '{"dtype": "float32", "shape": [2], "data": [-0.5, -1.0]}'
    )
