"""A completion notice's outcome (`operations.outcome_notice`): a result that cannot fit in the
notice is left out without being encoded, and no result that fits is left out for its size."""

from __future__ import annotations

import json
from typing import Any

import pytest

from treadle.platform.eventlog.optypes import OpType
from treadle.platform.operations import operations

LIMIT = 4096


def _shapes(n: int) -> list[Any]:
    """Results of n elements, the tightest (two bytes each) first."""
    return [
        {"data": [0] * n},
        {"rows": [[0]] * n},
        {"metrics": {str(i): 0 for i in range(n)}},
        {"loss_fn_outputs": [{"logprobs": {"data": [-0.5] * n}}]},
    ]


@pytest.mark.parametrize("n", [0, 1, 500, 1000, 2000, 2030, 2040, 2048, 2100, 3000])
def test_a_result_is_left_out_for_its_size_only_when_it_cannot_fit(n: int) -> None:
    for result in _shapes(n):
        notice = operations.outcome_notice(OpType.FORWARD_BACKWARD, result, None, max_bytes=LIMIT)
        fields = {
            "type": OpType.FORWARD_BACKWARD,
            "status": "completed",
            "result": result,
            "error": None,
        }
        encoded = len(json.dumps(fields, separators=(",", ":")))
        if notice is None:
            assert encoded > LIMIT, (n, result)
        else:
            assert json.loads(notice)["result"] == result
    assert operations.outcome_notice(OpType.FORWARD_BACKWARD, {"data": [0] * 2100}, None,
                                     max_bytes=LIMIT) is None  # fmt: skip


def test_a_large_result_is_not_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("encoded a result too large for the notice")

    large = {"loss_fn_outputs": [{"logprobs": {"data": [-0.5] * 256}}] * 8, "metrics": {}}
    monkeypatch.setattr(operations.json, "dumps", refuse)
    assert operations.outcome_notice(OpType.FORWARD_BACKWARD, large, None, max_bytes=LIMIT) is None
