"""The audit's summary of a completed operation reads its result as its typed class: counts for a
forward_backward's outputs and a sample's sequences, and a result that does not read as its type
shown generically rather than refused."""

from __future__ import annotations

from treadle.platform.audit.audit import summarize

FB = {
    "loss_fn_outputs": [{"logprobs": {"dtype": "float32", "shape": [2], "data": [-1.0, -2.0]}}] * 3,
    "metrics": {"loss:sum": 9.0},
}
SAMPLE = {
    "sequences": [
        {"tokens": [4, 5], "logprobs": [-0.5, -0.25], "stop_reason": "stop"},
        {"tokens": [6], "logprobs": [-1.0], "stop_reason": "length", "topk_logprobs": [[]]},
    ],
    "prompt_logprobs": [None, -1.0, -2.0],
    "topk_prompt_logprobs": None,
}


def _completed(op_type: str, result: dict) -> dict:
    return {"request_id": "r", "seq_id": 1, "type": op_type, "result": result}


def test_a_forward_backward_result_is_summarised_as_its_metrics_and_an_output_count() -> None:
    out = summarize("OperationCompleted", _completed("forward_backward", FB))
    assert out["result"] == {"summary": True, "metrics": {"loss:sum": 9.0}, "loss_fn_outputs": 3}


def test_a_sample_result_is_summarised_as_counts_and_stop_reasons() -> None:
    out = summarize("OperationCompleted", _completed("sample", SAMPLE))
    assert out["result"] == {
        "summary": True,
        "sequences": 2,
        "sampled_tokens": 3,
        "stop_reasons": ["stop", "length"],
        "prompt_logprobs": 3,
    }


def test_a_result_that_does_not_read_as_its_type_is_shown_as_it_is() -> None:
    damaged = {"sequences": "gone"}
    assert summarize("OperationCompleted", _completed("sample", damaged))["result"] == damaged
    other = {"model_id": "m"}
    assert summarize("OperationCompleted", _completed("create_model", other))["result"] == other
