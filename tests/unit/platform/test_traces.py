"""The trace builder (`treadle.platform.audit.traces`): one complete event per operation, times in
microseconds since the origin, and overlapping operations of one type on lanes of their own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from treadle.platform.audit import traces

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _op(
    n: int, start_ms: int, end_ms: int | None, *, track: str = "run", kind: str = "sample"
) -> traces.TracedOperation:
    return traces.TracedOperation(
        request_id=f"req-{n}", track=track, seq_id=n, type=kind, status="completed",
        created_at=T0 + timedelta(milliseconds=start_ms),
        completed_at=None if end_ms is None else T0 + timedelta(milliseconds=end_ms),
        tokens={"prefill": 3, "sample": 4, "train": 0},
    )  # fmt: skip


def _spans(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_times_are_microseconds_since_the_origin() -> None:
    (span,) = _spans(traces.build("sess-1", T0, [_op(1, 2, 5)], T0))
    assert (span["ts"], span["dur"]) == (2000, 3000)
    assert span["args"]["tokens"] == {"prefill": 3, "sample": 4, "train": 0}


def test_overlapping_operations_of_one_type_get_lanes_and_later_ones_reuse_them() -> None:
    trace = traces.build("sess-1", T0, [_op(1, 0, 10), _op(2, 5, 15), _op(3, 12, 20)], T0)
    tids = {s["args"]["request_id"]: s["tid"] for s in _spans(trace)}
    assert tids["req-1"] != tids["req-2"] and tids["req-3"] == tids["req-1"]
    threads = sorted(e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name")
    assert threads == ["sample", "sample (2)"]


def test_each_track_is_a_process_and_a_pending_operation_ends_now() -> None:
    ops = [_op(1, 0, 10, track="a"), _op(2, 0, None, track="b", kind="forward_backward")]
    trace = traces.build("sess-1", T0, ops, T0 + timedelta(milliseconds=40))
    spans = {s["args"]["request_id"]: s for s in _spans(trace)}
    assert spans["req-1"]["pid"] != spans["req-2"]["pid"]
    assert spans["req-2"]["dur"] == 40_000
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"a", "b"}
    assert trace["otherData"]["operations"] == 2
