"""Anthropic Messages request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`), parsed.

Text is served: messages whose content is a string or text blocks, a system prompt as a string
or text blocks, and the sampling parameters Anthropic defines (max_tokens, temperature, top_p,
top_k, stop_sequences), and `seed` (Treadle's extension, as OpenAI's). Tools, images, documents and extended thinking are refused with a 400
that says so; any other field is a 400 naming it. Several text blocks are joined with a blank
line. Imports platform only; never torch.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from treadle.api.body import reject_nul
from treadle.platform.errors import ValidationError

MAX_STOP_SEQUENCES = 16
_TYPE_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\])")
BLOCK_SEPARATOR = "\n\n"  # between the text blocks of one message or of the system prompt
# Content block types a text model cannot serve, and what to send instead.
_UNSERVED_BLOCKS = {
    "image": "image inputs are not supported: this server serves text models; send text blocks",
    "document": "document inputs are not supported: send the document's text as a text block",
    "tool_use": "tools are not supported by this server: send text blocks only",
    "tool_result": "tools are not supported by this server: send text blocks only",
    "server_tool_use": "tools are not supported by this server: send text blocks only",
    "thinking": "extended thinking is not supported: leave thinking blocks out",
    "redacted_thinking": "extended thinking is not supported: leave thinking blocks out",
}
# Top-level fields Anthropic defines that this server refuses, with the reason.
_UNSERVED_FIELDS = {
    "tools": "tools are not supported by this server; leave tools out",
    "tool_choice": "tools are not supported by this server; leave tool_choice out",
    "thinking": "extended thinking is not supported by this server; leave thinking out",
    "mcp_servers": "MCP servers are not supported by this server; leave mcp_servers out",
    "container": "containers are not supported by this server; leave container out",
}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted; nothing is cached
    # Treadle's extension (OpenAI's `seed`): the same seed samples the same reply
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    citations: list[dict[str, Any]] | None = None  # accepted; never produced


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    def text(self) -> str:
        return _text(self.content)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None  # accepted and ignored, as Anthropic's is for abuse detection


class _Prompt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=512)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None

    def chat(self) -> list[dict[str, str]]:
        """The conversation as chat-template messages, the system prompt first (an empty final
        assistant message is no prefill: it is left out)."""
        system = [] if self.system is None else [{"role": "system", "content": _text(self.system)}]
        turns = [{"role": m.role, "content": m.text()} for m in self.messages]
        if turns[-1]["role"] == "assistant" and not turns[-1]["content"]:
            turns.pop()
        return system + turns

    @property
    def is_prefill(self) -> bool:
        """A final, non-empty assistant message: the reply continues its text."""
        last = self.messages[-1]
        return last.role == "assistant" and bool(last.text())

    @pydantic.model_validator(mode="after")
    def _prefill_has_no_trailing_space(self) -> _Prompt:
        last = self.messages[-1]
        if last.role == "assistant" and last.text() != last.text().rstrip():
            raise ValueError(
                "final assistant content cannot end with trailing whitespace; strip it"
            )
        if all(m.role == "assistant" and not m.text() for m in self.messages):
            raise ValueError("the messages hold no content: send at least one user message")
        return self


class CountTokensRequest(_Prompt):
    pass


class MessagesRequest(_Prompt):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    cache_control: dict[str, Any] | None = None  # accepted; nothing is cached
    # Treadle's extension (OpenAI's `seed`): the same seed samples the same reply
    seed: int | None = Field(default=None, ge=0, lt=2**63)

    def stops(self) -> list[str] | None:
        if self.stop_sequences and any(not s for s in self.stop_sequences):
            raise ValidationError("stop_sequences: each stop sequence must be a non-empty string")
        return self.stop_sequences or None


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else BLOCK_SEPARATOR.join(b.text for b in content)


R = TypeVar("R", bound=_Prompt)


def parse(model: type[R], payload: Any) -> R:
    """A validated body; a 400 saying what is wrong (Anthropic's `field: reason`) otherwise."""
    if not isinstance(payload, dict):
        raise ValidationError("the request body must be a JSON object; send {...} with its fields")
    reject_nul(payload)
    for name, why in _UNSERVED_FIELDS.items():
        if payload.get(name):
            raise ValidationError(f"{name}: {why}")
    # an empty one (`tools: []`, as some harnesses send) asks for nothing: left out
    payload = {k: v for k, v in payload.items() if k not in _UNSERVED_FIELDS}
    _refuse_unserved_blocks(payload)
    try:
        return model.model_validate(payload)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        unknown = [
            ".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden"
        ]
        if unknown:
            raise ValidationError(
                f"{', '.join(unknown)}: Extra inputs are not permitted; this server does not "
                "serve them (docs/anthropic.md lists what it does); remove them"
            ) from None
        first = errors[0]
        # a union's error names the member type it tried ("content.str"): name the field itself
        where = ".".join(str(p) for p in first["loc"] if not _TYPE_TAG.fullmatch(str(p)))
        said = first["msg"].removeprefix("Value error, ")
        raise ValidationError(f"{where}: {said}" if where else said) from None


def _refuse_unserved_blocks(payload: dict[str, Any]) -> None:
    """A 400 naming the first content block of a type this server cannot serve."""
    places: list[tuple[str, Any]] = [("system", payload.get("system"))]
    messages = payload.get("messages")
    if isinstance(messages, list):
        places += [
            (f"messages.{i}.content", m.get("content"))
            for i, m in enumerate(messages)
            if isinstance(m, dict)
        ]
    for where, content in places:
        if not isinstance(content, list):
            continue
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind in _UNSERVED_BLOCKS:
                raise ValidationError(f"{where}.{j}.type: {_UNSERVED_BLOCKS[kind]}")
