"""Protobuf on the wire: `forward_backward` requests in, `ForwardBackwardOutput` and
`SampleResponse` results out (schema `tinker_public`, shipped with the pinned tinker SDK).

Requests become plain JSON-able payloads (token lists and `{dtype, shape, data}` tensors) that
the event log stores; results stored as JSON become proto bytes again on `retrieve_future`.
Imports platform only; never torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from treadle.platform.errors import ValidationError

_DTYPES: dict[int, tuple[str, np.dtype[Any]]] = {
    pb.DTYPE_FLOAT32: ("float32", np.dtype(np.float32)),
    pb.DTYPE_INT64: ("int64", np.dtype(np.int64)),
    pb.DTYPE_INT32: ("int64", np.dtype(np.int32)),
}
_PB_DTYPE = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_STOP_REASON = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def decode_forward_backward(body: bytes) -> dict[str, Any]:
    """Parse a ForwardBackwardRequest into {model_id, seq_id, payload}."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise ValidationError(
            f"forward_backward body is not a valid ForwardBackwardRequest protobuf ({exc}); "
            "send it with Content-Type: application/x-protobuf as the tinker SDK does"
        ) from exc
    if any("\x00" in k for k in [*msg.loss_fn_config, *msg.loss_fn_config_v2]):
        raise ValidationError("a loss_fn_config key contains a NUL character")
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "number":
            config[key] = float(value.number)
        elif value.WhichOneof("value") == "text":
            raise ValidationError(
                f"loss_fn_config[{key!r}] is a string; only numeric loss_fn_config values are accepted"
            )
    if "\x00" in msg.model_id or "\x00" in msg.loss_fn:
        raise ValidationError("model_id and loss_fn may not contain NUL characters")
    data = [_datum(i, d) for i, d in enumerate(msg.data)]
    return {
        "model_id": msg.model_id,
        "seq_id": int(msg.seq_id),
        "payload": {
            "loss_fn": msg.loss_fn,
            "loss_fn_config": config,
            "forward_only": bool(msg.forward_only),
            "data": data,
        },
    }


def _datum(index: int, d: pb.Datum) -> dict[str, Any]:
    tokens: list[int] = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ValidationError(
                f"datum {index}: model_input has a {kind} chunk; only encoded_text (token) chunks "
                "are supported by this server"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    if any("\x00" in name for name in d.loss_fn_inputs):
        raise ValidationError(f"datum {index}: a loss_fn_inputs name contains a NUL character")
    inputs = {name: _tensor(index, name, t) for name, t in d.loss_fn_inputs.items()}
    return {"tokens": tokens, "loss_fn_inputs": inputs}


def _tensor(index: int, name: str, t: pb.Tensor) -> dict[str, Any]:
    if t.dtype not in _DTYPES:
        raise ValidationError(
            f"datum {index}: loss_fn_inputs[{name!r}] has unsupported dtype {t.dtype}; "
            "use float32 or int64"
        )
    label, np_dtype = _DTYPES[t.dtype]
    shape = [int(s) for s in t.shape]
    try:
        if t.WhichOneof("encoding") == "sparse_csr":
            values = np.frombuffer(t.sparse_csr.values, dtype=np_dtype)
            crow = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
            if len(shape) != 2:
                raise ValueError("a sparse CSR tensor needs a 2-D shape")
            dense = np.zeros(shape, dtype=np_dtype)
            for row in range(shape[0]):
                lo, hi = int(crow[row]), int(crow[row + 1])
                dense[row, col[lo:hi]] = values[lo:hi]
            array = dense
        else:
            array = np.frombuffer(t.dense, dtype=np_dtype)
            if shape:
                array = array.reshape(shape)
    except (ValueError, IndexError) as exc:
        raise ValidationError(
            f"datum {index}: loss_fn_inputs[{name!r}] is malformed ({exc}); its data must match "
            "its shape"
        ) from exc
    if label == "float32" and not np.all(np.isfinite(array)):
        raise ValidationError(
            f"datum {index}: loss_fn_inputs[{name!r}] contains NaN or infinity; send finite numbers"
        )
    return {"dtype": label, "shape": list(array.shape), "data": array.reshape(-1).tolist()}


def encode_forward_backward_output(result: Mapping[str, Any]) -> bytes:
    """Stored result {loss_fn_outputs: [{name: {dtype, shape, data}}], metrics} -> proto bytes."""
    outputs: list[Mapping[str, Any]] = result["loss_fn_outputs"]
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    names = list(outputs[0]) if outputs else []
    for name in names:
        dtype = outputs[0][name]["dtype"]
        np_dtype = np.float32 if dtype == "float32" else np.int64
        arrays = [np.asarray(o[name]["data"], dtype=np_dtype) for o in outputs]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        trailing = [int(s) for s in outputs[0][name]["shape"][1:]]
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays),
                offsets=offsets.tobytes(),
                dtype=_PB_DTYPE[dtype],
                trailing_shape=trailing,
            )
        )
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in result["metrics"].items():
        msg.metrics[key] = float(value)
    return msg.SerializeToString()


def encode_sample_response(result: Mapping[str, Any]) -> bytes:
    msg = pb.SampleResponse()
    for seq in result["sequences"]:
        msg.sequences.append(
            pb.SampledSequence(
                stop_reason=_STOP_REASON[seq["stop_reason"]],
                tokens=np.asarray(seq["tokens"], dtype=np.int32).tobytes(),
                logprobs=np.asarray(seq["logprobs"], dtype=np.float32).tobytes(),
            )
        )
    prompt_logprobs = result.get("prompt_logprobs")
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    topk = result.get("topk_prompt_logprobs")
    if topk:
        msg.topk_prompt_logprobs.CopyFrom(_topk(topk))
    return msg.SerializeToString()


def _topk(rows: list[list[list[float]]]) -> pb.TopkLogprobs:
    """Per position [[token, logprob], ...] -> [length, k] arrays, empty slots (0, -99999)."""
    k = max((len(r) for r in rows), default=0)
    token_ids = np.zeros((len(rows), k), dtype=np.int32)
    logprobs = np.full((len(rows), k), -99999.0, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row):
            token_ids[i, j] = int(token)
            logprobs[i, j] = logprob
    return pb.TopkLogprobs(
        token_ids=token_ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows)
    )
