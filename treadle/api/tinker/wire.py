"""Protobuf on the wire: `forward_backward` requests in, `ForwardBackwardOutput` and
`SampleResponse` results out (schema `tinker_public`, shipped with the pinned tinker SDK).

Requests become plain JSON-able payloads (token lists and `{dtype, shape, data}` tensors) that
the event log stores; results stored as JSON become proto bytes again on `retrieve_future`.
Nothing is allocated in proportion to what a request declares: the body's fields are counted
before it is parsed, and every tensor's shape and sparse indices are checked against its datum's
token count and the body's size before anything dense is built (limits in platform.validation).
Imports platform only; never torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from treadle.api.tinker import proto as tinker_proto
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog.results import (
    ForwardBackwardOutput,
    SampleOutput,
    TargetLogprobs,
    TopkRows,
)
from treadle.platform.models.validation import (
    FWDBWD_MAX_CHUNK_LEN,
    MAX_DATUMS,
    MAX_LOSS_INPUTS,
    MAX_PROTO_FIELDS,
    MAX_TENSOR_RANK,
    MAX_VALUES_PER_TOKEN,
    SPARSE_VALUE_ALLOWANCE,
)
from treadle.platform.models.vision import IMAGE_PLACEHOLDER

if TYPE_CHECKING:  # the SDK's copy of the module, for its type stubs
    from tinker.proto import tinker_public_pb2 as pb
else:
    pb = tinker_proto.load()

# Bytes fields hold raw little-endian arrays.
_DTYPES: dict[int, tuple[str, np.dtype[Any]]] = {
    pb.DTYPE_FLOAT32: ("float32", np.dtype("<f4")),
    pb.DTYPE_INT64: ("int64", np.dtype("<i8")),
    pb.DTYPE_INT32: ("int64", np.dtype("<i4")),
}
_TOKEN = np.dtype("<i4")
_INDEX = np.dtype("<i8")
_PB_DTYPE = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_WIRE_DTYPE: dict[str, np.dtype[Any]] = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}
_STOP_REASON = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
_REQUEST: Descriptor = pb.ForwardBackwardRequest.DESCRIPTOR
_DATA_FIELD = _REQUEST.fields_by_name["data"].number
_OPAQUE = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
_NOT_A_REQUEST = "send it with Content-Type: application/x-protobuf as the tinker SDK does"


def decode_forward_backward(
    body: bytes, on_seq: Callable[[str, int], None] | None = None
) -> dict[str, Any]:
    """Parse a ForwardBackwardRequest into {model_id, seq_id, payload, loss_id} (loss_id: a
    custom loss's, sent as loss_fn_config["loss_id"] with loss_fn "custom"; else None).

    `on_seq(model_id, seq_id)` runs as soon as those are read, before the rest is checked (the
    route notes the seq_id, so a refusal of the request's contents releases it).
    """
    _count_fields(body)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise ValidationError(
            f"forward_backward body is not a valid ForwardBackwardRequest protobuf ({exc}); "
            + _NOT_A_REQUEST
        ) from exc
    if "\x00" in msg.model_id or "\x00" in msg.loss_fn:
        raise ValidationError("model_id and loss_fn may not contain NUL characters")
    if on_seq is not None:
        on_seq(msg.model_id, int(msg.seq_id))
    if any("\x00" in k for k in [*msg.loss_fn_config, *msg.loss_fn_config_v2]):
        raise ValidationError("a loss_fn_config key contains a NUL character")
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    loss_id: str | None = None
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "number":
            config[key] = float(value.number)
        elif value.WhichOneof("value") == "text":
            if key == "loss_id" and msg.loss_fn == "custom":  # create_custom_loss's id
                loss_id = value.text
                continue
            raise ValidationError(
                f"loss_fn_config[{key!r}] is a string; only numeric loss_fn_config values are "
                "accepted (a string loss_id only with loss_fn 'custom')"
            )
    budget = _Budget(len(body))
    data = [_datum(i, d, budget) for i, d in enumerate(msg.data)]
    return {
        "model_id": msg.model_id,
        "seq_id": int(msg.seq_id),
        "payload": {
            "loss_fn": msg.loss_fn,
            "loss_fn_config": config,
            "forward_only": bool(msg.forward_only),
            "data": data,
        },
        "loss_id": loss_id,
    }


def _count_fields(body: bytes) -> None:
    """Walk the protobuf wire format without parsing it, counting fields at every depth (a packed
    array counts one per byte) and the datums. The parser allocates per field, so an empty
    message of a few bytes costs it ~56: these counts bound that before it runs."""
    fields = datums = 0
    stack: list[tuple[int, int, Descriptor | None]] = [(0, len(body), _REQUEST)]
    while stack:
        start, end, message = stack.pop()
        layout = _layout(message)
        pos = start
        while pos < end:
            key = body[pos]  # one byte for every field number below 16, as in these messages
            pos += 1
            if key >= 0x80:
                key, pos = _varint(body, pos - 1, end)
            number, wire_type = key >> 3, key & 7
            fields += 1
            if wire_type == 2:
                length, pos = _varint(body, pos, end)
                inner, packed = layout.get(number, (None, False))
                if inner is not None:
                    stack.append((pos, min(pos + length, end), inner))
                elif packed:
                    fields += length  # up to one element per byte
                pos += length
            elif wire_type == 0:
                _, pos = _varint(body, pos, end)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            else:
                raise _malformed(f"wire type {wire_type} of field {number}")
            if pos > end:
                raise _malformed(f"field {number} runs past the end of its message")
            if message is _REQUEST and number == _DATA_FIELD:
                datums += 1
                if datums > MAX_DATUMS:
                    raise ValidationError(
                        f"more than {MAX_DATUMS} datums in one forward_backward request; send at "
                        f"most {MAX_DATUMS} (the tinker SDK sends {FWDBWD_MAX_CHUNK_LEN} per "
                        "request, as client/config tells it)"
                    )
            if fields > MAX_PROTO_FIELDS:
                raise ValidationError(
                    f"the forward_backward body holds more than {MAX_PROTO_FIELDS} protobuf "
                    "fields; send fewer datums, chunks or tensors per request"
                )


_LAYOUTS: dict[str, dict[int, tuple[Descriptor | None, bool]]] = {}


def _layout(message: Descriptor | None) -> dict[int, tuple[Descriptor | None, bool]]:
    """Field number -> (its message type if it is one, whether it is a packed scalar array)."""
    if message is None:  # an unknown field's contents are kept as bytes, never parsed
        return {}
    if message.full_name not in _LAYOUTS:
        _LAYOUTS[message.full_name] = {
            f.number: (f.message_type, f.message_type is None and f.type not in _OPAQUE)
            for f in message.fields
        }
    return _LAYOUTS[message.full_name]


def _varint(body: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 70:
        byte = body[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _malformed("a truncated or overlong varint")


def _malformed(what: str) -> ValidationError:
    return ValidationError(
        f"forward_backward body is not a valid ForwardBackwardRequest protobuf ({what}); "
        + _NOT_A_REQUEST
    )


class _Budget:
    """The tensor values a request may declare: one per 4 bytes of its body (what dense tensors
    can carry) plus SPARSE_VALUE_ALLOWANCE, since sparse tensors are stored dense."""

    def __init__(self, body_bytes: int) -> None:
        self.body_bytes = body_bytes
        self.limit = body_bytes // 4 + SPARSE_VALUE_ALLOWANCE
        self.spent = 0

    def spend(self, where: str, values: int) -> None:
        self.spent += values
        if self.spent > self.limit:
            raise ValidationError(
                f"{where}: the request's tensors declare {self.spent} values or more in a "
                f"{self.body_bytes}-byte body; a request may declare at most one value per 4 "
                f"bytes of its body plus {SPARSE_VALUE_ALLOWANCE} (sparse tensors are stored "
                "dense): send dense tensors, or fewer values"
            )


def _datum(index: int, d: pb.Datum, budget: _Budget) -> dict[str, Any]:
    parts: list[np.ndarray[Any, Any]] = []
    images: list[dict[str, Any]] = []
    at = 0
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind == "image":
            image = _image(index, chunk.image, at)
            images.append(image)
            parts.append(np.full(image["expected_tokens"], IMAGE_PLACEHOLDER, np.int64))
            at += image["expected_tokens"]
            continue
        if kind != "encoded_text":
            raise ValidationError(
                f"datum {index}: model_input has a {kind} chunk; this server takes encoded_text "
                "(token) chunks and image chunks"
            )
        parts.append(
            _array(f"datum {index}: model_input tokens", chunk.encoded_text.tokens, _TOKEN)
        )
        at += len(parts[-1])
    tokens: list[int] = np.concatenate(parts).tolist() if parts else []
    if len(d.loss_fn_inputs) > MAX_LOSS_INPUTS:
        raise ValidationError(
            f"datum {index}: loss_fn_inputs has {len(d.loss_fn_inputs)} tensors; send at most "
            f"{MAX_LOSS_INPUTS} (the losses take at most 3)"
        )
    if any("\x00" in name for name in d.loss_fn_inputs):
        raise ValidationError(f"datum {index}: a loss_fn_inputs name contains a NUL character")
    inputs = {
        name: _tensor(f"datum {index}: loss_fn_inputs[{name!r}]", t, len(tokens), budget)
        for name, t in d.loss_fn_inputs.items()
    }
    datum: dict[str, Any] = {"tokens": tokens, "loss_fn_inputs": inputs}
    if images:  # placed (the placeholders made image tokens) once the model is known
        datum["images"] = images
    if d.model_input_spans or d.loss_fn_input_spans:
        datum["provenance"] = {
            "model_input": [_span(index, "model_input_spans", s) for s in d.model_input_spans],
            "targets": [_span(index, "loss_fn_input_spans", s) for s in d.loss_fn_input_spans],
        }
    return datum


def _image(index: int, image: pb.ImageChunk, at: int) -> dict[str, Any]:
    """An image chunk as {at, format, data, expected_tokens}: where its tokens begin and how
    many it says it is (`platform.models.vision` admits it against the model)."""
    if not image.HasField("expected_tokens") or image.expected_tokens <= 0:
        raise ValidationError(
            f"datum {index}: an image chunk has no expected_tokens; a training datum's length "
            "counts the image's tokens, so set it (tinker_cookbook's image_to_chunk does)"
        )
    if image.HasField("override_dimensions"):
        raise ValidationError(
            f"datum {index}: an image chunk sets override_dimensions; this server sizes an image "
            "by its own pixels: resize the image instead"
        )
    return {
        "at": at,
        "format": image.format,
        "data": bytes(image.data),
        "expected_tokens": int(image.expected_tokens),
    }


def _span(index: int, field: str, span: pb.ProvenanceSpan) -> dict[str, Any]:
    """A provenance span as {kind, sequence_id, offset, length}; its claims are checked against
    the recorded sequences later (platform.recorded_samples)."""
    kind = span.WhichOneof("span")
    if kind is None:
        raise ValidationError(
            f"datum {index}: a {field} entry is empty; each span is prompt_tokens or "
            "sampled_tokens (Datum.with_provenance builds them)"
        )
    arm = getattr(span, kind)
    if not arm.sequence_id or "\x00" in arm.sequence_id:
        raise ValidationError(f"datum {index}: a {field} entry has no valid sequence_id")
    if arm.offset < 0 or arm.length < 0:
        raise ValidationError(
            f"datum {index}: a {field} entry has offset {arm.offset} and length {arm.length}; "
            "neither may be negative"
        )
    return {
        "kind": "prompt" if kind == "prompt_tokens" else "sampled",
        "sequence_id": arm.sequence_id,
        "offset": int(arm.offset),
        "length": int(arm.length),
    }


def _tensor(where: str, t: pb.Tensor, n_tokens: int, budget: _Budget) -> dict[str, Any]:
    """A tensor as {dtype, shape, data}; its declared shape is checked before anything is built."""
    if t.dtype not in _DTYPES:
        raise ValidationError(f"{where} has unsupported dtype {t.dtype}; use float32 or int64")
    label, np_dtype = _DTYPES[t.dtype]
    if len(t.shape) > MAX_TENSOR_RANK:
        raise ValidationError(
            f"{where} has rank {len(t.shape)}; loss_fn_inputs tensors are 1-D (one value per "
            "token) or 2-D"
        )
    shape = list(t.shape)
    if min(shape, default=0) < 0:
        raise ValidationError(f"{where} has shape {shape}; a dimension cannot be negative")
    sparse = t.WhichOneof("encoding") == "sparse_csr"
    if sparse:
        if len(shape) != 2:
            raise ValidationError(
                f"{where} is sparse (CSR) with shape {shape}; a sparse tensor needs a 2-D shape "
                "[rows, columns]"
            )
        declared = math.prod(shape)
    else:
        values = _array(where, t.dense, np_dtype)
        declared = math.prod(shape) if shape else values.size
        if declared != values.size:
            raise ValidationError(
                f"{where} has {values.size} values but its shape {shape} holds {declared}; "
                "its data must match its shape"
            )
    allowed = max(n_tokens, 1) * MAX_VALUES_PER_TOKEN
    if declared > allowed or any(s > allowed for s in shape):
        raise ValidationError(
            f"{where} declares shape {shape} ({declared} values) but its datum has {n_tokens} "
            f"tokens; a loss_fn_inputs tensor holds at most {MAX_VALUES_PER_TOKEN} values per "
            "token (one per token: a 1-D tensor as long as model_input; cross_entropy also takes "
            f"[N, K] target_tokens and weights, K <= {MAX_VALUES_PER_TOKEN})"
        )
    budget.spend(where, declared)
    array = _csr_to_dense(where, t.sparse_csr, shape, np_dtype) if sparse else values
    if label == "float32" and not np.isfinite(array).all():
        raise ValidationError(f"{where} contains NaN or infinity; send finite numbers")
    out_shape = shape or [array.size]
    return {"dtype": label, "shape": out_shape, "data": array.reshape(-1).tolist()}


def _csr_to_dense(
    where: str, csr: pb.SparseCsr, shape: list[int], np_dtype: np.dtype[Any]
) -> np.ndarray[Any, Any]:
    """The dense array of a CSR tensor whose dense size was already bounded; the index arrays are
    checked first (their sizes are what was sent, not what was declared)."""
    rows, cols = shape
    values = _array(f"{where} sparse_csr.values", csr.values, np_dtype)
    crow = _array(f"{where} sparse_csr.crow_indices", csr.crow_indices, _INDEX)
    col = _array(f"{where} sparse_csr.col_indices", csr.col_indices, _INDEX)
    if crow.size != rows + 1:
        raise ValidationError(
            f"{where} has {crow.size} crow_indices; a CSR tensor of {rows} rows needs {rows + 1}"
        )
    counts = np.diff(crow)
    if crow[0] != 0 or (counts < 0).any() or crow[-1] != col.size:
        raise ValidationError(
            f"{where}: crow_indices must start at 0, never decrease and end at the number of "
            f"col_indices ({col.size})"
        )
    if values.size != col.size:
        raise ValidationError(
            f"{where} has {values.size} values for {col.size} col_indices; send one value per "
            "column index"
        )
    if col.size and (col.min() < 0 or col.max() >= cols):
        raise ValidationError(
            f"{where} has a column index outside [0, {cols}); every col_indices entry must be a "
            "column of its shape"
        )
    row_of = np.repeat(np.arange(rows), counts)
    if ((row_of[1:] == row_of[:-1]) & (col[1:] <= col[:-1])).any():
        raise ValidationError(
            f"{where}: col_indices must increase within each row (sorted, no repeats)"
        )
    if np.issubdtype(np_dtype, np.floating) and not np.isfinite(values).all():
        raise ValidationError(f"{where} contains NaN or infinity; send finite numbers")
    dense = np.zeros((rows, cols), dtype=np_dtype)
    dense[row_of, col] = values
    return dense


def _array(where: str, raw: bytes, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    if len(raw) % dtype.itemsize:
        raise ValidationError(
            f"{where} has {len(raw)} bytes, not a whole number of {dtype.itemsize}-byte values; "
            "send whole little-endian values"
        )
    return np.frombuffer(raw, dtype=dtype)


def encode_forward_backward_output(stored: Mapping[str, Any]) -> bytes:
    """A stored forward_backward result (`ForwardBackwardOutput`) -> proto bytes."""
    result = ForwardBackwardOutput.model_validate(stored)
    outputs = result.loss_fn_outputs
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    names = list(outputs[0]) if outputs else []
    for name in names:
        first = outputs[0][name]
        np_dtype = np.float32 if first.dtype == "float32" else np.int64
        arrays = [np.asarray(o[name].data, dtype=np_dtype) for o in outputs]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays),
                offsets=offsets.tobytes(),
                dtype=_PB_DTYPE[first.dtype],
                trailing_shape=first.shape[1:],
            )
        )
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in result.metrics.items():
        msg.metrics[key] = value
    return msg.SerializeToString()


def encode_sample_response(stored: Mapping[str, Any]) -> bytes:
    """A stored sample result (`SampleOutput`) -> SampleResponse proto bytes: per sequence its
    tokens, logprobs, stop reason and (if asked) top-k logprobs; prompt logprobs (NaN where not
    scored), their top-k, target_prompt_logprobs in the request's dense or CSR layout,
    prompt_alt_tokens."""
    result = SampleOutput.model_validate(stored)
    msg = pb.SampleResponse()
    for seq in result.sequences:
        sequence = pb.SampledSequence(
            stop_reason=_STOP_REASON[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
        if seq.topk_logprobs is not None:
            sequence.topk_sampled_logprobs.CopyFrom(_topk(seq.topk_logprobs))
        msg.sequences.append(sequence)
    if result.prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in result.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if result.topk_prompt_logprobs:
        msg.topk_prompt_logprobs.CopyFrom(_topk(result.topk_prompt_logprobs))
    if result.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(_target_tensor(result.target_prompt_logprobs))
    alt = result.prompt_alt_tokens
    if alt is not None:
        shape = [len(alt.tokens), alt.k]
        msg.prompt_alt_tokens.tokens.CopyFrom(_dense(alt.tokens, "int64", shape))
        msg.prompt_alt_tokens.logprobs.CopyFrom(_dense(alt.logprobs, "float32", shape))
    return msg.SerializeToString()


def _dense(values: Any, dtype: str, shape: list[int]) -> pb.Tensor:
    """A dense little-endian tensor of `values` ("int64" or "float32") with `shape`."""
    array = np.asarray(values, dtype=_WIRE_DTYPE[dtype]).reshape(shape)
    return pb.Tensor(dense=array.tobytes(), dtype=_PB_DTYPE[dtype], shape=shape)


def _target_tensor(targets: TargetLogprobs) -> pb.Tensor:
    """Logprobs in the layout the request's target ids came in: dense [rows, k], or CSR with its
    row pointers and column indices."""
    shape = [targets.rows, targets.k]
    if targets.crow_indices is None:
        return _dense(targets.values, "float32", shape)
    return pb.Tensor(
        sparse_csr=pb.SparseCsr(
            values=np.asarray(targets.values, dtype=_WIRE_DTYPE["float32"]).tobytes(),
            crow_indices=np.asarray(targets.crow_indices, dtype=_INDEX).tobytes(),
            col_indices=np.asarray(targets.col_indices, dtype=_INDEX).tobytes(),
        ),
        dtype=pb.DTYPE_FLOAT32,
        shape=shape,
    )


def _topk(rows: TopkRows) -> pb.TopkLogprobs:
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
