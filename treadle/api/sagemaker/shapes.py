"""Requests (and, in tests, responses) checked against botocore's own SageMaker service models.

Owns the one validator of the SageMaker surface: `ServiceShapes.of("sagemaker")` (json 1.1) or
`ServiceShapes.of("sagemakertrainingsessionruntime")` (rest-json) loads the model that botocore
ships, once per process, and walks an operation's input or output shape over a parsed body.
botocore checks only types, required members and `min` client-side, so every range, length,
pattern, enum, union and unknown member is checked here; a bad request raises one
`ValidationError` in AWS's wording ("1 validation error detected: Value 'a_b' at
'trainingSessionName' failed to satisfy constraint: ..."). Imports botocore, regex and
treadle.platform.errors only; never torch or the worker.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import threading
from collections.abc import Mapping
from datetime import datetime
from itertools import islice
from typing import Any, ClassVar

import regex
from botocore.loaders import create_loader
from botocore.model import ServiceModel, Shape

from treadle.platform.errors import ValidationError

__all__ = ["MAX_REPORTED", "ServiceShapes"]

MAX_REPORTED = 10  # violations listed in one message; the walk stops at the next one
_INT_BOUNDS = {"integer": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}
_NON_FINITE = frozenset({"NaN", "Infinity", "-Infinity"})  # how botocore serialises them
# Java's \d and \w (the models' dialect) are ASCII; the regex module's are Unicode.
_JAVA_ASCII = {r"\d": "0-9", r"\w": "a-zA-Z0-9_"}
_JAVA_TOKEN = regex.compile(r"\[(?:\\.|[^\]\\])*\]|\\.")  # a character class, or one escape
_ESCAPE = regex.compile(r"\\.")
_CONTROL = regex.compile(r"\p{Cc}")
_MUST_BE = {
    "boolean": "a boolean",
    "timestamp": "a timestamp (epoch seconds or an ISO 8601 string)",
    "blob": "base64-encoded bytes in a string",
}
_KINDS: dict[type, str] = {
    bool: "a boolean",
    int: "an integer",
    float: "a decimal number",
    str: "a string",
    dict: "an object",
    list: "a list",
    type(None): "null",
    bytes: "bytes",
}


class ServiceShapes:
    """One botocore service model and the checks of its operations' inputs and outputs."""

    _loaded: ClassVar[dict[str, ServiceShapes]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, model: ServiceModel) -> None:
        self.model = model

    @classmethod
    def of(cls, service_name: str) -> ServiceShapes:
        """The model botocore ships for `service_name`, loaded on the first call per process."""
        with cls._lock:
            if service_name not in cls._loaded:
                data = create_loader().load_service_model(service_name, "service-2")
                cls._loaded[service_name] = cls(ServiceModel(data, service_name=service_name))
            return cls._loaded[service_name]

    def has_operation(self, operation_name: str) -> bool:
        return operation_name in self.model.operation_names

    def validate_input(self, operation_name: str, params: Mapping[str, Any]) -> None:
        """Raise `ValidationError` listing what in `params` breaks the operation's input shape.

        `params` is the parsed body with any URI and header members merged in under their
        member names; a payload blob (the raw body) may be bytes. An operation the model
        lacks raises botocore's `OperationNotFoundError`: ask `has_operation` first.
        """
        _Walk(is_output=False).run(self.model.operation_model(operation_name).input_shape, params)

    def validate_output(self, operation_name: str, data: Mapping[str, Any]) -> None:
        """The same walk over the output shape, for tests of the surface's responses."""
        _Walk(is_output=True).run(self.model.operation_model(operation_name).output_shape, data)


class _TooMany(Exception):
    """Ends a walk that has found more violations than one message lists."""


class _Walk:
    """One walk over a value; collects the violations it finds in order."""

    def __init__(self, is_output: bool) -> None:
        self.is_output = is_output  # botocore reads lists as sparse: a null item is allowed
        self.problems: list[str] = []

    def run(self, shape: Shape | None, value: Any) -> None:
        try:
            if shape is None:  # an operation without input or output: only {} fits
                if value:
                    self.fail(f"Expected an empty object, got {_show(value)}")
            else:
                self.check(shape, value, "", sensitive=False)
        except _TooMany:
            head = f"More than {MAX_REPORTED} validation errors detected; the first {MAX_REPORTED}"
        else:
            if not self.problems:
                return
            count = len(self.problems)
            head = f"{count} validation error{'s' if count > 1 else ''} detected"
        raise ValidationError(f"{head}: " + "; ".join(self.problems))

    def fail(self, problem: str) -> None:
        if len(self.problems) == MAX_REPORTED:
            raise _TooMany
        self.problems.append(problem)

    def violate(self, value: Any, path: str, constraint: str, sensitive: bool) -> None:
        # Like AWS, the value of a `sensitive` shape (a datum, a prompt) is never echoed.
        shown = " " + _show(value) if value is None or not sensitive else ""
        self.fail(f"Value{shown} at '{path}' failed to satisfy constraint: {constraint}")

    def check(self, shape: Shape, value: Any, path: str, sensitive: bool) -> None:
        metadata = shape.metadata
        sensitive = sensitive or bool(metadata.get("sensitive"))
        if metadata.get("document"):
            return  # any JSON value; the caller checks documents itself
        if value is None:  # a null list item or map value (a null member counts as absent)
            self.violate(None, path, "Member must not be null", sensitive)
            return
        kind = shape.type_name
        if kind == "structure":
            self.structure(shape, value, path, sensitive)
        elif kind == "list":
            self.sequence(shape, value, path, sensitive)
        elif kind == "map":
            self.mapping(shape, value, path, sensitive)
        else:
            for constraint in _scalar_problems(shape, value):
                self.violate(value, path, constraint, sensitive)

    def structure(self, shape: Shape, value: Any, path: str, sensitive: bool) -> None:
        if not isinstance(value, dict):
            self.violate(value, path, f"Member must be an object, not {_kind(value)}", sensitive)
            return
        members = shape.members
        where = f" at '{path}'" if path else ""
        for key in value:
            if key not in members:
                accepted = ", ".join(members) or "none"
                self.fail(f"Unknown member {_show(key)}{where}; accepted members: {accepted}")
        present = [name for name in members if value.get(name) is not None]  # null = absent
        if shape.metadata.get("union") and len(present) != 1:
            got = f"got {len(present)}: {', '.join(present)}" if present else "got none"
            self.fail(f"At '{path}', exactly one of {', '.join(members)} must be set; {got}")
        for name in shape.required_members:
            if value.get(name) is None:
                self.violate(None, _join(path, name), "Member must not be null", sensitive)
        for name in present:
            self.check(members[name], value[name], _join(path, name), sensitive)

    def sequence(self, shape: Shape, value: Any, path: str, sensitive: bool) -> None:
        if not isinstance(value, list):
            self.violate(value, path, f"Member must be a list, not {_kind(value)}", sensitive)
            return
        self.size(shape, value, path, sensitive)
        if _all_plain_numbers(shape.member, value):
            return
        for index, item in enumerate(value):
            if item is not None or not self.is_output:
                self.check(shape.member, item, f"{path}[{index}]", sensitive)

    def mapping(self, shape: Shape, value: Any, path: str, sensitive: bool) -> None:
        if not isinstance(value, dict):
            self.violate(value, path, f"Member must be an object, not {_kind(value)}", sensitive)
            return
        self.size(shape, value, path, sensitive)
        for key, item in value.items():
            key_problems = _scalar_problems(shape.key, key)
            if key_problems:
                constraint = f"Map keys must satisfy constraint: [{', '.join(key_problems)}]"
                self.violate(key, path, constraint, sensitive)
            self.check(shape.value, item, f"{path}[{_brief(key, 32)}]", sensitive)

    def size(self, shape: Shape, value: Any, path: str, sensitive: bool) -> None:
        for constraint in _length_problems(shape.metadata, len(value)):
            self.violate(value, path, constraint, sensitive)


def _scalar_problems(shape: Shape, value: Any) -> list[str]:
    """What a scalar `value` breaks of `shape`, as AWS's "Member must ..." phrases."""
    kind, metadata = shape.type_name, shape.metadata
    if kind == "string":
        if not isinstance(value, str):
            return [f"Member must be a string, not {_kind(value)}"]
        problems = _length_problems(metadata, len(value))
        enum = metadata.get("enum")
        if enum and value not in enum:
            problems.append(f"Member must satisfy enum value set: [{', '.join(enum)}]")
        pattern = metadata.get("pattern")
        # A string already refused (a length, an enum) is not matched: a long one costs time.
        if pattern is not None and not problems and _compiled(pattern).fullmatch(value) is None:
            problems.append(f"Member must satisfy regular expression pattern: {pattern}")
        return problems
    if kind in _INT_BOUNDS:
        if type(value) is not int:
            return [f"Member must be an integer, not {_kind(value)}"]
        return _value_problems(shape, value)
    if kind in ("double", "float"):
        if isinstance(value, str) and value in _NON_FINITE:
            return [f"Member must be a finite number, not the string '{value}'"]
        if type(value) not in (int, float):
            return [f"Member must be a number, not {_kind(value)}"]
        if type(value) is float and not math.isfinite(value):
            return ["Member must be a finite number"]
        return _value_problems(shape, value)
    if kind == "boolean":
        fits = type(value) is bool
    elif kind == "timestamp":
        fits = _is_timestamp(value)
    elif kind == "blob":
        fits = _is_blob(value)
    else:
        raise AssertionError(f"shape {shape.name} has type {kind}, unknown to the validator")
    return [] if fits else [f"Member must be {_MUST_BE[kind]}, not {_kind(value)}"]


def _bounds(shape: Shape) -> tuple[float | None, float | None]:
    """A number's `min` and `max`: the model's, else (for integers) what 32 or 64 bits hold."""
    low, high = _INT_BOUNDS.get(shape.type_name, (None, None))
    return shape.metadata.get("min", low), shape.metadata.get("max", high)


def _value_problems(shape: Shape, value: float) -> list[str]:
    low, high = _bounds(shape)
    if low is not None and value < low:
        return [f"Member must have value greater than or equal to {low}"]
    if high is not None and value > high:
        return [f"Member must have value less than or equal to {high}"]
    return []


def _length_problems(metadata: Mapping[str, Any], length: int) -> list[str]:
    if "min" in metadata and length < metadata["min"]:
        return [f"Member must have length greater than or equal to {metadata['min']}"]
    if "max" in metadata and length > metadata["max"]:
        return [f"Member must have length less than or equal to {metadata['max']}"]
    return []


def _all_plain_numbers(member: Shape, items: list[Any]) -> bool:
    """True when every item is an in-range number, checked with builtins only: token lists run
    to millions of items, too many to walk one by one. False sends the list down the slow walk."""
    kind = member.type_name
    if kind in _INT_BOUNDS:
        if not set(map(type, items)) <= {int}:
            return False
    elif kind in ("double", "float"):
        if not all(type(item) is int or _is_finite_float(item) for item in items):
            return False
    else:
        return False
    low, high = _bounds(member)
    return not items or (
        (low is None or min(items) >= low) and (high is None or max(items) <= high)
    )


def _is_finite_float(value: Any) -> bool:
    return type(value) is float and math.isfinite(value)


def _is_timestamp(value: Any) -> bool:
    if type(value) is int or _is_finite_float(value):
        return True
    if isinstance(value, str):
        try:
            datetime.fromisoformat(value)
        except ValueError:
            return False
        return True
    return False


def _is_blob(value: Any) -> bool:
    if isinstance(value, bytes | bytearray):  # a payload blob: the raw body
        return True
    if isinstance(value, str):
        try:
            base64.b64decode(value, validate=True)
        except binascii.Error:
            return False
        return True
    return False


@functools.cache
def _compiled(pattern: str) -> Any:
    """The model's (Java) pattern compiled once; `fullmatch` because AWS anchors it."""
    return regex.compile(_JAVA_TOKEN.sub(_ascii_classes, pattern))


def _ascii_classes(match: Any) -> str:
    """One character class or escape of a Java pattern with Java's ASCII \\d and \\w."""
    token: str = match.group()
    if token.startswith("["):
        return _ESCAPE.sub(lambda escape: _JAVA_ASCII.get(escape.group(), escape.group()), token)
    return f"[{_JAVA_ASCII[token]}]" if token in _JAVA_ASCII else token


def _join(path: str, name: str) -> str:
    """AWS names a member in its messages with the first letter lowered (`loraConfig.rank`)."""
    name = name[:1].lower() + name[1:]
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    """A value as AWS quotes it in a message ('a_b', '0.02', null), cut short when long."""
    text = "null" if value is None else f"'{_brief(value, 64)}'"
    return text if len(text) <= 160 else f"{text[:156]}...'"


def _brief(value: Any, limit: int, depth: int = 0) -> str:
    if isinstance(value, str):
        text = value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"
        return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
    if isinstance(value, list | dict):
        if depth == 2:
            parts = ["..."]
        elif isinstance(value, list):
            parts = [_brief(item, 16, depth + 1) for item in value[:5]]
        else:
            items = islice(value.items(), 5)
            parts = [f"{_brief(k, 16, depth + 1)}={_brief(v, 16, depth + 1)}" for k, v in items]
        if len(value) > 5 and depth < 2:
            parts.append(f"... ({len(value)} in all)")
        opening, closing = "[]" if isinstance(value, list) else "{}"
        return opening + ", ".join(parts) + closing
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, int) and value.bit_length() > 64:  # repr could run to 4,300 digits
        return f"<an integer of {value.bit_length()} bits>"
    return repr(value) if isinstance(value, int | float) else type(value).__name__
