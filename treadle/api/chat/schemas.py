"""OpenAI's completion request bodies (the OpenAI-compatible routes', SageMaker's inference), parsed.

Every field OpenAI defines that Treadle serves is here; any other field (an unsupported OpenAI
parameter such as `response_format`, or a misspelling) is a 400 naming it in OpenAI's `param`,
as is a penalty other than 0. Chats may offer `tools` (checked by `treadle.client.tool_calls`,
shared with the SDK, which needs no tinker SDK) and carry tool calls and tool results. Imports
platform and `treadle.client.tool_calls` only; never torch.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator

from treadle.api.body import reject_nul
from treadle.client import tool_calls
from treadle.platform.errors import ValidationError
from treadle.platform.models.validation import MAX_TOPK_LOGPROBS

MAX_CHOICES = 16  # n: samples per request
MAX_STOPS = 4  # OpenAI's limit on stop sequences
_TYPE_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\]|literal\[.*\]|[A-Z]\w*)")


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


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def _shaped_for_its_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message, and only a tool message, carries tool_call_id")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (an assistant message may send tool_calls)")
        return self

    def plain(self) -> dict[str, Any]:
        """The message as the chat template takes it ("developer" is the system's role)."""
        out = self.model_dump(exclude_none=True, exclude={"name"})
        if self.role == "developer":
            out["role"] = "system"
        return out


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOPK_LOGPROBS)
    tools: list[Any] | None = None  # OpenAI function tools, checked by `offered_tools`
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools the model is offered: none when `tool_choice` is "none"; a 400 naming
        `tools` or `tool_choice` when they are malformed or do not agree."""
        try:
            tools = tool_calls.validate_tools(self.tools) if self.tools else []
        except ValueError as exc:
            raise ParamError(f"invalid tools: {exc}", "tools") from None
        choice = self.tool_choice
        if choice is not None and choice != "none" and not tools:
            raise ParamError("tool_choice needs tools; send tools or leave tool_choice out",
                             "tool_choice")  # fmt: skip
        if isinstance(choice, NamedToolChoice):
            names = [tool["function"]["name"] for tool in tools]
            if choice.function.name not in names:
                raise ParamError(
                    f"tool_choice names function {choice.function.name!r}, which is not among "
                    f"the tools {names}; name one of them",
                    "tool_choice",
                )
        return [] if choice == "none" else tools


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
