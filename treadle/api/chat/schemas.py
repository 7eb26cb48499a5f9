"""OpenAI's completion request bodies (the OpenAI-compatible routes', SageMaker's inference), parsed.

Every field OpenAI defines that Treadle serves is here; any other field (an unsupported OpenAI
parameter such as `tools`, or a misspelling) is a 400 naming it in OpenAI's `param`, as is a
penalty other than 0. Imports platform only; never torch.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from treadle.api.body import reject_nul
from treadle.platform.errors import ValidationError
from treadle.platform.models.validation import MAX_TOPK_LOGPROBS

MAX_CHOICES = 16  # n: samples per request
MAX_STOPS = 4  # OpenAI's limit on stop sequences
_TYPE_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\])")


class ParamError(ValidationError):
    """A 400 about one request parameter, named in OpenAI's error `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:  # type: ignore[override]
        return (type(self), (self.message, self.param))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=512)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's is for abuse monitoring only
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def stops(self) -> list[str] | None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (len(stops) > MAX_STOPS or any(not s for s in stops)):
            raise ParamError(f"stop takes 1 to {MAX_STOPS} non-empty strings", "stop")
        return stops or None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOPK_LOGPROBS)


class CompletionRequest(_Common):
    prompt: str = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's completions allow 5
    echo: bool = False
    best_of: int | None = None


R = TypeVar("R", bound=_Common)


def parse(model: type[R], payload: Any) -> R:
    """A validated body; a 400 naming the first bad parameter (OpenAI's `param`) otherwise."""
    if not isinstance(payload, dict):
        raise ValidationError("the request body must be a JSON object; send {...} with its fields")
    reject_nul(payload)
    try:
        body = model.model_validate(payload)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        unknown = [
            ".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden"
        ]
        if unknown:
            raise ParamError(
                f"unsupported parameter(s): {', '.join(unknown)}; this server does not serve "
                "them (docs/openai.md lists what it does); remove them",
                unknown[0],
            ) from None
        first = errors[0]
        # a union's error names the member type it tried ("stop.str"): name the field itself
        loc = [str(p) for p in first["loc"] if not _TYPE_TAG.fullmatch(str(p))]
        param = ".".join(loc) or None
        raise ParamError(
            f"invalid parameter {param}: {first['msg'].removeprefix('Value error, ')}", param
        ) from None
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise ParamError(f"{name} is not supported; send 0 or leave it out", name)
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise ParamError("echo is not supported; leave it out", "echo")
        if body.best_of not in (None, 1, body.n):
            raise ParamError("best_of is not supported; leave it out", "best_of")
    if body.stream_options is not None and not body.stream:
        raise ParamError("stream_options needs stream: true", "stream_options")
    return body
