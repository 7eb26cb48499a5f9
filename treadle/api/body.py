"""Reading JSON request bodies: strict, bounded JSON before pydantic ever sees it, then `parse`
into the surface's pydantic model (`Body`; unknown fields are ignored, as the Tinker protocol's
evolving clients expect), a failure a 400 naming each bad field.

The size limit is Flask's (MAX_CONTENT_LENGTH, a 413). Then a linear scan of the raw bytes
refuses bodies nested deeper than MAX_JSON_DEPTH or holding more than MAX_JSON_VALUES values, so
the parser below can neither recurse without bound nor build millions of objects; the parser
itself refuses NaN and Infinity literals, floats that overflow and integers of more than
MAX_INT_DIGITS digits (before int() runs), and unpaired UTF-16 surrogates, naming the field.
Imports platform only; never torch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from datetime import UTC, date, datetime
from typing import Annotated, Any, TypeVar

import numpy as np
import pydantic
from flask import Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from treadle.platform.errors import ValidationError
from treadle.platform.models.validation import (
    MAX_ID_LENGTH,
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
)

# A JSON string, or an unterminated one up to the end: the optional closing quote means a match
# never fails, so the scan stays linear whatever the quotes and backslashes.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b"[]{},")
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1
_SCAN_CHUNK = 1 << 20
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_UNPAIRED = "a string with an unpaired UTF-16 surrogate (\\ud800 to \\udfff)"


class _Refused:
    """A number the parser will not hand on; where it sits is found after parsing."""

    def __init__(self, why: str) -> None:
        self.why = why


def read_json(request: Request) -> Any:
    """The request's JSON body (None when it is empty); ValidationError naming what is wrong."""
    raw = request.get_data(cache=True)  # Flask refuses one over MAX_CONTENT_LENGTH (413)
    if not raw.strip():
        return None
    return loads(raw)


def loads(raw: bytes, *, max_values: int = MAX_JSON_VALUES) -> Any:
    """Parse a JSON body within the limits (see the module docstring); `max_values` raises the
    value limit for a surface whose clients send larger bodies."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(
            f"the request body is not UTF-8 (byte {exc.start}); send JSON encoded as UTF-8"
        ) from None
    depth, values = _shape(raw)
    if depth > MAX_JSON_DEPTH:
        raise ValidationError(
            f"the JSON body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
            f"flatten it to at most {MAX_JSON_DEPTH} levels"
        )
    if values > max_values:
        raise ValidationError(
            f"the JSON body holds about {values} values; at most {max_values} are accepted "
            "in one request: send fewer or split the request"
        )
    refused: list[_Refused] = []

    def refuse(why: str) -> _Refused:
        refused.append(_Refused(why))
        return refused[-1]

    def parse_int(digits: str) -> int | _Refused:
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            return refuse(
                f"an integer of {len(digits.lstrip('-'))} digits; integers have at most "
                f"{MAX_INT_DIGITS} digits (64 bits): send a smaller number"
            )
        return int(digits)

    def parse_float(number: str) -> float | _Refused:
        value = float(number)
        if math.isinf(value):
            return refuse(f"{_clip(number)}, which overflows a 64-bit float; send a finite number")
        return value

    def parse_constant(name: str) -> _Refused:
        return refuse(f"{name}, which JSON does not allow; send a finite number or null")

    try:
        value = json.loads(
            text, parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant
        )
    except json.JSONDecodeError as exc:
        raise ValidationError(
            f"the request body is not valid JSON ({exc.msg}: line {exc.lineno} column "
            f"{exc.colno}); send a JSON object"
        ) from None
    if refused or _SURROGATE_ESCAPE.search(raw):
        problem = next(_problems(value), None)
        if problem is not None:
            raise ValidationError(f"{problem[0]} is {problem[1]}")
    return value


def _shape(raw: bytes) -> tuple[int, int]:
    """(deepest nesting, an upper bound on the number of values) of a JSON text, in linear time
    and bounded memory: strings are cut out, then the brackets left are summed in chunks. UTF-8
    never puts an ASCII byte inside a multi-byte character, so bytes are as good as characters."""
    skeleton = _STRING.sub(b"", raw).translate(None, _NOT_STRUCTURE)
    values = skeleton.count(b",") + skeleton.count(b"[") + skeleton.count(b"{") + 1
    codes = np.frombuffer(skeleton, dtype=np.uint8)
    deepest = level = 0
    for start in range(0, codes.size, _SCAN_CHUNK):
        levels = np.cumsum(_DEPTH_STEP[codes[start : start + _SCAN_CHUNK]], dtype=np.int32)
        deepest = max(deepest, level + int(levels.max()))
        level += int(levels[-1])
        if deepest > MAX_JSON_DEPTH:
            break
    return deepest, values


def _problems(value: Any) -> Iterator[tuple[str, str]]:
    """(field path, what is wrong) for each refused number and unpaired surrogate, in order."""
    stack: list[tuple[str, Any]] = [("body", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, _Refused):
            yield path, item.why
        elif isinstance(item, str):
            if _SURROGATE.search(item):
                yield path, f"{_UNPAIRED}; send valid Unicode"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if _SURROGATE.search(key):
                    where = "the body" if path == "body" else path
                    yield f"a key of {where}", f"{_UNPAIRED}; send valid Unicode"
                stack.append((key if path == "body" else f"{path}.{key}", child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


MAX_ID = 2**62  # seq ids and counters fit a BIGINT with room to spare
MAX_TTL = 10 * 365 * 24 * 3600


def _utc(value: Any) -> Any:
    """A date means its UTC midnight; a time with no offset is UTC; years outside
    2000-9998 are refused (they cannot hold usage, and near the ends they overflow)."""
    if isinstance(value, str) and len(value) == 10 and value[4:5] == "-":
        try:
            value = datetime.combine(date.fromisoformat(value), datetime.min.time(), UTC)
        except ValueError:
            raise ValueError(f"{value!r} is not a date; write YYYY-MM-DD") from None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(
                f"{value!r} is not an ISO 8601 time; write e.g. 2026-11-01T00:00:00Z"
            ) from None
    if isinstance(value, datetime):
        if not 2000 <= value.year <= 9998:
            raise ValueError(f"{value.isoformat()} is out of range; give a year 2000-9998")
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    raise ValueError("give an ISO 8601 time, e.g. 2026-11-01T00:00:00Z")


Id = Annotated[str, Field(max_length=MAX_ID_LENGTH)]  # ids, names, paths, base model names
Time = Annotated[datetime, BeforeValidator(_utc)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)


B = TypeVar("B", bound=Body)


def reject_nul(value: Any, where: str = "body") -> None:
    """PostgreSQL text cannot hold NUL; no identifier or name of ours may contain it."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValidationError(f"{where} contains a NUL character; remove it")
    elif isinstance(value, dict):
        for key, item in value.items():
            reject_nul(key, where)
            reject_nul(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            reject_nul(item, f"{where}[{i}]")


def parse(model: type[B], payload: Any) -> B:
    """Validate a JSON body; a failure is a 400 that names each bad field."""
    if not isinstance(payload, dict):
        raise ValidationError("the request body must be a JSON object; send {...} with its fields")
    reject_nul(payload)
    try:
        return model.model_validate(payload)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: "
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        )
        raise ValidationError(f"invalid {model.__name__} request: {problems}") from None
