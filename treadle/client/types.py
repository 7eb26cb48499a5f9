"""The one SDK type the tinker SDK lacks in the form SageMaker's SDK users write it: a
`TensorData` whose dtype may be left out (`TensorData(data=[...])`), and the `TensorDtype`
enum they name one with (`TensorDtype.INT64`). Every other type is tinker's own (`Datum`,
`ModelInput`, `AdamParams`, `SamplingParams`, results). Imports nothing from the server side.
"""

from __future__ import annotations

import contextlib
import dataclasses
from enum import StrEnum
from typing import Any, Literal

import numpy as np
from tinker import types

WireDtype = Literal["float32", "int64"]

# The only integer input any loss takes; every other loss_fn_inputs tensor is float32
# (semantics.md: weights, logprobs, advantages, per-token clip thresholds).
INTEGER_INPUTS = frozenset({"target_tokens"})


class TensorDtype(StrEnum):
    """A tensor's element type. The Tinker wire carries float32 and int64; the other members,
    which SageMaker's SDK also names, are widened to those when the tensor is built
    (float16 and bfloat16 to float32, int32 to int64), so no value changes."""

    FLOAT32 = "float32"
    INT64 = "int64"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT32 = "int32"


_WIDENED: dict[str, WireDtype] = {
    "float32": "float32",
    "float16": "float32",
    "bfloat16": "float32",
    "int64": "int64",
    "int32": "int64",
}


def wire_dtype(dtype: object) -> WireDtype:
    """The wire dtype for `dtype`: a TensorDtype, its string, or a numpy / torch dtype.

    Raises:
        ValueError: a dtype that is neither a float nor an integer type.
    """
    name = str(getattr(dtype, "value", dtype)).removeprefix("torch.")
    if name in _WIDENED:
        return _WIDENED[name]
    kind = ""
    with contextlib.suppress(TypeError):  # not a dtype numpy knows
        kind = np.dtype(dtype if isinstance(dtype, type) else name).kind
    if kind == "f":
        return "float32"
    if kind and kind in "iub":
        return "int64"
    raise ValueError(
        f"unsupported tensor dtype {dtype!r}: use TensorDtype.FLOAT32 or TensorDtype.INT64 "
        "(or a numpy / torch float or integer dtype)"
    )


def _dtype_of_values(data: Any) -> WireDtype:
    kind = np.asarray(data).dtype.kind if data is not None else "f"
    return "int64" if kind in "iub" else "float32"


class TensorData(types.TensorData):
    """The tinker SDK's TensorData, whose dtype may be left out.

    Without a dtype the tensor is decided twice: when built, by its values (int64 if every
    value is an integer, else float32), and again when a datum carrying it is sent through
    Treadle's TrainingClient (`forward`, `forward_backward`), by the key it sits under:
    int64 under `target_tokens`, float32 under any other key (as SageMaker's SDK does for
    plain lists). So `TensorData(data=[0, 0, 1])` goes out as float32 under `weights`. A
    given dtype is always kept. Handed to the plain tinker SDK, a tensor keeps its built dtype.

    Args:
        data: the values: a list (nested for more than one dimension), a numpy array or a
            CPU torch tensor.
        dtype: a TensorDtype (or "float32" / "int64", or a numpy / torch dtype); optional.
        shape: the tensor's shape; default the shape of `data`.
    Raises:
        ValueError: a dtype that is neither a float nor an integer type.
    Example:
        weights = treadle.TensorData(data=[0.0, 1.0, 1.0])
        targets = treadle.TensorData(data=[5, 6, 7], dtype=treadle.TensorDtype.INT64)
    """

    dtype_given: bool

    def __init__(
        self,
        data: Any = None,
        dtype: object = None,
        shape: list[int] | None = None,
        sparse_crow_indices: list[int] | None = None,
        sparse_col_indices: list[int] | None = None,
    ) -> None:
        wire = _dtype_of_values(data) if dtype is None else wire_dtype(dtype)
        super().__init__(data, wire, shape, sparse_crow_indices, sparse_col_indices)
        object.__setattr__(self, "dtype_given", dtype is not None)

    def for_input(self, key: str) -> types.TensorData:
        """This tensor as sent under `loss_fn_inputs[key]`: itself if its dtype was given or
        already fits the key, else its values as the key's dtype.

        Raises:
            ValueError: non-integer values under `target_tokens`.
        """
        wanted: WireDtype = "int64" if key in INTEGER_INPUTS else "float32"
        if self.dtype_given or self.dtype == wanted:
            return self
        sparse = self.sparse_crow_indices is not None
        values = np.asarray(self.data) if sparse else self.to_numpy()
        if wanted == "int64" and not np.all(np.mod(values, 1) == 0):
            raise ValueError(
                f"loss_fn_inputs[{key!r}] holds non-integer values; {key} are token ids: "
                "pass integers"
            )
        return types.TensorData(
            data=values.astype(np.int64 if wanted == "int64" else np.float32),
            dtype=wanted,
            shape=self.shape,
            sparse_crow_indices=self.sparse_crow_indices,
            sparse_col_indices=self.sparse_col_indices,
        )


def as_sent(datum: types.Datum) -> types.Datum:
    """`datum` with each dtype-less TensorData in the dtype of the key it sits under."""
    inputs = {
        key: value.for_input(key) if isinstance(value, TensorData) else value
        for key, value in datum.loss_fn_inputs.items()
    }
    if all(inputs[key] is value for key, value in datum.loss_fn_inputs.items()):
        return datum
    return dataclasses.replace(datum, loss_fn_inputs=inputs)
