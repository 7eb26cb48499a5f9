"""A request declaring a huge tensor in a few bytes is refused without the API's memory growing:
measured around the in-process request, both as the peak of Python's allocations (tracemalloc,
which numpy reports its buffers to) and as the peak resident set size of the process (VmHWM,
reset before the request). Issue 8 saw a 152-byte request take the API from 348 MB to 1.9 GB."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb

from tests.secure_app import SecureApp

pytestmark = pytest.mark.integration

MB = 1024 * 1024
PYTHON_BUDGET = 2 * MB  # peak Python/numpy allocation while the request is refused
RSS_BUDGET = 16 * MB  # peak resident growth (the interpreter's arenas and the driver's buffers)


def _tensor(shape: list[int], *, sparse: bool) -> pb.Tensor:
    if sparse:
        csr = pb.SparseCsr(crow_indices=np.zeros(2, dtype="<i8").tobytes())
        return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, sparse_csr=csr)
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, dense=b"\0" * 12)


DECLARATIONS = {
    "sparse [1, 4e7] (the issue's case)": ([1, 40_000_000], True),
    "sparse [4e7, 1]": ([40_000_000, 1], True),
    "dense [4e7] holding 3 values": ([40_000_000], False),
    "dense [2**31, 2**31]": ([2**31, 2**31], False),
}


def _body(model_id: str, shape: list[int], sparse: bool) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2, 3], dtype="<i4").tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dtype=pb.DTYPE_INT64, shape=[3], dense=np.array([2, 3, 4], "<i8").tobytes())
    )
    datum.loss_fn_inputs["weights"].CopyFrom(_tensor(shape, sparse=sparse))
    return msg.SerializeToString()


@pytest.fixture(scope="module")
def model_id(secure: SecureApp) -> str:
    session = secure.call("POST", "/api/v1/create_session", secure.operator_key, json={})
    body = {
        "session_id": session.get_json()["session_id"],
        "model_seq_id": 0,
        "base_model": "treadle/tiny-debug",
    }
    answer = secure.call("POST", "/api/v1/create_model", secure.operator_key, json=body)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    return str(answer.get_json()["model_id"])


def _post(secure: SecureApp, body: bytes) -> Any:
    headers = {"Content-Type": "application/x-protobuf"}
    return secure.call(
        "POST", "/api/v1/forward_backward", secure.operator_key, data=body, headers=headers
    )


@pytest.fixture
def warmed(secure: SecureApp, model_id: str) -> Iterator[None]:
    """One refused request first, so lazy imports, caches and pooled connections are in place
    before anything is measured."""
    _post(secure, _body(model_id, [1, 40_000_000], True))
    yield


@pytest.mark.usefixtures("warmed")
@pytest.mark.parametrize(("shape", "sparse"), DECLARATIONS.values(), ids=DECLARATIONS.keys())
def test_huge_declared_tensor_is_refused_within_a_python_allocation_budget(
    secure: SecureApp, model_id: str, shape: list[int], sparse: bool
) -> None:
    body = _body(model_id, shape, sparse)
    assert len(body) < 200  # a few bytes declaring tens of millions of values
    before = secure.event_count()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        answer = _post(secure, body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert answer.status_code == 400, answer.get_data(as_text=True)
    assert "loss_fn_inputs['weights']" in answer.get_json()["error"]["message"]
    assert peak - baseline < PYTHON_BUDGET, f"peak {(peak - baseline) / MB:.1f} MB"
    assert secure.event_count() == before


def _status_kb(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split(f"{field}:")[1].split()[0])


@pytest.mark.usefixtures("warmed")
def test_huge_declared_tensor_is_refused_without_resident_memory_growth(
    secure: SecureApp, model_id: str
) -> None:
    # Linux: writing 5 resets VmHWM, the peak resident set size, to the current size.
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kb("VmHWM")
    answer = _post(secure, _body(model_id, [1, 40_000_000], True))
    growth = (_status_kb("VmHWM") - before) * 1024
    assert answer.status_code == 400, answer.get_data(as_text=True)
    assert growth < RSS_BUDGET, f"peak RSS grew by {growth / MB:.1f} MB"
