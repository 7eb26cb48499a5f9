"""A client session's timeline as a trace file (`tinker session export-trace`), built from its
operations: pure, no I/O.

The file is the Chrome/Catapult JSON trace format (`{"traceEvents": [...], "displayTimeUnit":
"ms"}`), which ui.perfetto.dev and chrome://tracing open; the tinker CLI names it `.pftrace`
and Perfetto detects the format by content. One complete event ("ph": "X") per operation, from
its admission to its completion (queueing included: the log records no start time), ts and dur
in microseconds since the client session's creation. A process (pid) per training run or
sampler, a thread (tid) per operation type; overlapping operations of one type (pipelined or
concurrent requests) get lanes of their own, since a thread's events must nest.
Imports nothing from api, engine, worker, Flask or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

MICROSECOND = timedelta(microseconds=1)


@dataclass(frozen=True)
class TracedOperation:
    request_id: str
    track: str  # the training run, or the sampler, the operation ran on
    seq_id: int
    type: str
    status: str
    created_at: datetime
    completed_at: datetime | None  # None while it is pending
    tokens: Mapping[str, int] | None  # by token class, once it completed


def build(
    client_session_id: str,
    origin: datetime,
    ops: Sequence[TracedOperation],
    now: datetime,
) -> dict[str, Any]:
    """The trace of `ops`: times relative to `origin`; a pending operation ends at `now`."""
    ordered = sorted(ops, key=lambda o: (o.created_at, o.track, o.seq_id, o.request_id))
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str, int], int] = {}
    lane_ends: dict[tuple[str, str], list[datetime]] = {}
    meta: list[dict[str, Any]] = []
    spans: list[dict[str, Any]] = []
    for op in ordered:
        pid = pids.get(op.track)
        if pid is None:
            pid = pids[op.track] = len(pids) + 1
            meta.append(_meta("process_name", pid, None, op.track))
        end = op.completed_at or max(now, op.created_at)
        lanes = lane_ends.setdefault((op.track, op.type), [])
        lane = next((i for i, free_at in enumerate(lanes) if free_at <= op.created_at), None)
        if lane is None:
            lane = len(lanes)
            lanes.append(end)
        lanes[lane] = end
        tid = tids.get((op.track, op.type, lane))
        if tid is None:
            tid = tids[(op.track, op.type, lane)] = len(tids) + 1
            name = op.type if lane == 0 else f"{op.type} ({lane + 1})"
            meta.append(_meta("thread_name", pid, tid, name))
        spans.append(
            {
                "ph": "X",
                "name": op.type,
                "cat": "sampling" if op.type == "sample" else "training",
                "pid": pid,
                "tid": tid,
                "ts": (op.created_at - origin) // MICROSECOND,
                "dur": max((end - op.created_at) // MICROSECOND, 0),
                "args": {
                    "request_id": op.request_id,
                    "seq_id": op.seq_id,
                    "status": op.status,
                    "tokens": dict(op.tokens) if op.tokens is not None else None,
                },
            }
        )
    return {
        "traceEvents": meta + spans,
        "displayTimeUnit": "ms",
        "otherData": {
            "client_session_id": client_session_id,
            "time_origin": origin.isoformat(),
            "exported_at": now.isoformat(),
            "operations": len(spans),
        },
    }


def encode(trace: Mapping[str, Any]) -> bytes:
    return json.dumps(trace, separators=(",", ":")).encode()


def _meta(kind: str, pid: int, tid: int | None, name: str) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "name": kind, "pid": pid, "ts": 0, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event
