"""Conversations with tool calls in the model's own chat format: rendered to token ids, tool
calls parsed back from sampled text, and the token positions that are the model's own.

Messages are in OpenAI's shape: roles system / user / assistant / tool; an assistant message may
carry `tool_calls` ([{id, type: "function", function: {name, arguments}}], arguments a JSON
object or its JSON text); a tool message carries `tool_call_id` and its `content`. Tools are
OpenAI function tools ({type: "function", function: {name, description?, parameters?}}).

A chat template that renders both `tools` and `tool_calls` (Qwen2.5, Qwen3, SmolLM3, Hermes)
renders the conversation itself. Any other template is given the generic format, which is
Qwen2.5's (the Hermes format) written into plain messages that the model's template renders as
text: the tool schemas, one JSON object a line inside `<tools></tools>`, and the instruction to
answer with `<tool_call>` blocks, appended to the system message (a system message holding only
them is put first when there is none, replacing any default system prompt of the template); an
assistant's calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` after its
text, one per line; the results of consecutive tool messages as one user turn of
`<tool_response>\\n...\\n</tool_response>` blocks. Parsing reads the Hermes `<tool_call>` JSON of
both. A template that renders tools in another format is rendered, but its calls are not parsed
(`tool_call_format` says so).

Pure Python: the tokenizer (a transformers tokenizer) is an argument; imports neither torch nor
anything of the server side, and nothing of `treadle.client` either, so the server can use it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HERMES",
    "ToolCall",
    "ToolCallParseError",
    "ToolFormatError",
    "assistant_spans",
    "assistant_weights",
    "normalise_messages",
    "parse_tool_calls",
    "render",
    "render_text",
    "template_supports_tools",
    "tool_call_format",
    "validate_tools",
]

HERMES = "hermes"  # `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_GENERIC_TOOLS_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ToolCallParseError(ValueError):
    """A tool call in sampled text that cannot be read; the message says what is wrong."""


class ToolFormatError(ValueError):
    """A chat template whose tool calls are in a format this module cannot parse."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` is the decoded JSON object."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI `tool_calls` entry (arguments as JSON text)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


def _template_texts(tokenizer: Any) -> list[str]:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates, e.g. {"default": ..., "tool_use": ...}
        return [str(t) for t in template.values()]
    return [template] if isinstance(template, str) else []


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools itself: it reads both the `tools`
    variable (the schemas) and messages' `tool_calls`."""
    return any(
        re.search(r"\btools\b", text) and "tool_calls" in text
        for text in _template_texts(tokenizer)
    )


def tool_call_format(tokenizer: Any) -> str:
    """The format of the calls this model writes: HERMES for the generic format and for
    templates that write `<tool_call>` blocks.

    Raises:
        ToolFormatError: the template renders tools in another format (e.g. Llama 3.1's bare
            JSON, Mistral's [TOOL_CALLS]), which `parse_tool_calls` cannot read.
    """
    if not template_supports_tools(tokenizer) or any(
        _OPEN in text for text in _template_texts(tokenizer)
    ):
        return HERMES
    raise ToolFormatError(
        "this model's chat template renders tool calls in a format other than Hermes "
        "<tool_call> JSON blocks; only that format is parsed"
    )


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """`tools` checked to be OpenAI function tools, as plain dicts.

    Raises:
        ValueError: what is wrong and where ("tools[1].function.name: ...").
    """
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise ValueError("tools must be a list of {type: 'function', function: {...}} objects")
    seen: set[str] = set()
    checked = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ValueError(f"{where}: each tool must be an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{where}.function: must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"{where}.function.name: must be 1 to 64 letters, digits, '_', '.', ':' or '-'"
            )
        if name in seen:
            raise ValueError(f"{where}.function.name: {name!r} is declared twice")
        seen.add(name)
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"{where}.function.description: must be a string")
        parameters = function.get("parameters", {})
        if not isinstance(parameters, Mapping):
            raise ValueError(f"{where}.function.parameters: must be a JSON Schema object")
        checked.append({"type": "function", "function": json.loads(json.dumps(function))})
    return checked


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ValueError(f"{where}.content: must be a string or a list of text parts")


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON ({exc}): {raw[:200]!r}") from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {raw!r:.200}")
    return dict(raw)


def _call(call: Any, where: str, default_id: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function: must be an object with a name")
    arguments = _arguments(function.get("arguments", {}), f"{where}.function.arguments")
    return {
        "id": str(call.get("id") or default_id),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with text content (None and text parts joined to a string) and each call's
    arguments decoded to a dict, the shape chat templates expect.

    Raises:
        ValueError: a message that is not an object with a role, a call without a function
            name, arguments that are not a JSON object, a tool message without content.
    """
    normal = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: must be an object with a role")
        out = {**message, "content": _text(message.get("content"), where)}
        if message.get("tool_calls"):
            if message["role"] != "assistant":
                raise ValueError(f"{where}: only assistant messages carry tool_calls")
            calls = [
                _call(call, f"{where}.tool_calls[{j}]", f"call_{i}_{j}")
                for j, call in enumerate(message["tool_calls"])
            ]
            out["tool_calls"] = calls
        else:
            out.pop("tool_calls", None)
        normal.append(out)
    return normal


def _call_text(function: Mapping[str, Any]) -> str:
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]})
    return f"{_OPEN}\n{body}\n{_CLOSE}"


def _generic(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` in the generic format: plain role/content messages any template renders."""
    plain: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant" and message.get("tool_calls"):
            parts = [content] if content else []
            parts += [_call_text(call["function"]) for call in message["tool_calls"]]
            plain.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if plain and plain[-1].get("tool_results"):
                plain[-1]["content"] += "\n" + response
            else:
                plain.append({"role": "user", "content": response, "tool_results": True})
        else:
            plain.append({"role": role, "content": content})
    for message in plain:
        message.pop("tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(tool) for tool in tools)
        prompt = _GENERIC_TOOLS_PROMPT.format(tools=listing)
        if plain and plain[0]["role"] == "system":
            plain[0]["content"] = f"{plain[0]['content']}\n\n{prompt}".lstrip()
        else:
            plain.insert(0, {"role": "system", "content": prompt})
    return plain


def render_text(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool,
) -> str:
    """The conversation as text, through the model's chat template (see `render`)."""
    checked = validate_tools(tools) if tools else []
    normal = normalise_messages(messages)
    if template_supports_tools(tokenizer):
        text = tokenizer.apply_chat_template(
            normal,
            tools=checked or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    else:
        text = tokenizer.apply_chat_template(
            _generic(normal, checked), add_generation_prompt=add_generation_prompt, tokenize=False
        )
    return str(text)


def render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool,
) -> list[int]:
    """The token ids of the conversation: through the model's chat template with `tools` when
    it renders tools, in the generic format (module docstring) otherwise.

    Args:
        tokenizer: the model's tokenizer (transformers), with a chat template.
        messages: OpenAI-shaped messages, tool calls and tool results included.
        tools: OpenAI function tools offered to the model, or None.
        add_generation_prompt: end with the opening of an assistant turn (for sampling).
    Raises:
        ValueError: malformed tools or messages (what is wrong and where).

    Example:
        tokens = render(tok, [{"role": "user", "content": "Weather in Paris?"}], tools,
                        add_generation_prompt=True)
    """
    text = render_text(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _check_tool_name(name: str, tools: Sequence[Mapping[str, Any]] | None, where: str) -> None:
    if tools is None:
        return
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        raise ToolCallParseError(f"{where}: calls {name!r}, which is not one of the tools {names}")


def _read_call(body: str, where: str, tools: Sequence[Mapping[str, Any]] | None) -> ToolCall:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ToolCallParseError(f"{where}: not valid JSON ({exc}): {body[:200]!r}") from None
    if not isinstance(parsed, dict):
        raise ToolCallParseError(f"{where}: must be a JSON object with a name, got {body[:200]!r}")
    name = parsed.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallParseError(f"{where}: has no function name (a string under 'name')")
    _check_tool_name(name, tools, where)
    try:
        arguments = _arguments(parsed.get("arguments", {}), f"{where}: 'arguments'")
    except ValueError as exc:
        raise ToolCallParseError(str(exc)) from None
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=arguments)


def parse_tool_calls(
    tokenizer_or_format: Any,
    text: str,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str, list[ToolCall]]:
    """The assistant's text without its tool calls (stripped), and the calls, in order.

    Args:
        tokenizer_or_format: the model's tokenizer, or a format name (HERMES).
        text: the sampled text of one assistant turn, special tokens left out.
        tools: when given, a call to a function not among them is an error.
    Raises:
        ToolCallParseError: a call that cannot be read (unclosed `<tool_call>`, a stray
            `</tool_call>`, JSON that does not parse, no name, arguments not an object, an
            unknown function); the message says which call and what is wrong.
        ToolFormatError: the tokenizer's template writes calls in another format.

    Example:
        text, calls = parse_tool_calls(tok, 'Looking.\\n<tool_call>\\n{"name": "f"}\\n</tool_call>')
        # ("Looking.", [ToolCall(id="call_...", name="f", arguments={})])
    """
    fmt = tokenizer_or_format
    if not isinstance(fmt, str):
        fmt = tool_call_format(tokenizer_or_format)
    if fmt != HERMES:
        raise ToolFormatError(f"unknown tool-call format {fmt!r}; the one known is {HERMES!r}")
    pieces: list[str] = []
    calls: list[ToolCall] = []
    rest = text
    while True:
        start, stray = rest.find(_OPEN), rest.find(_CLOSE)
        if stray != -1 and (start == -1 or stray < start):
            raise ToolCallParseError(f"{_CLOSE} without a {_OPEN} before it")
        if start == -1:
            pieces.append(rest)
            break
        pieces.append(rest[:start])
        end = rest.find(_CLOSE, start)
        where = f"tool call {len(calls) + 1}"
        if end == -1:
            raise ToolCallParseError(f"{where}: {_OPEN} is never closed by {_CLOSE}")
        body = rest[start + len(_OPEN) : end]
        if _OPEN in body:
            raise ToolCallParseError(f"{where}: {_OPEN} opened again before {_CLOSE}")
        calls.append(_read_call(body.strip(), where, tools))
        rest = rest[end + len(_CLOSE) :]
    return "".join(pieces).strip(), calls


def assistant_spans(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[tuple[int, int]]:
    """For each assistant message, the [start, end) token positions in
    `render(tokenizer, messages, tools, add_generation_prompt=False)` that the model itself
    writes: its text and calls and the end-of-turn token, not the turn's opening (the
    generation prompt) nor the whitespace the template puts after the turn.

    Found by rendering the conversation up to each assistant turn with the generation prompt,
    and up to its end without: the template must render a conversation's earlier turns as it
    renders them when they are the last (true of ChatML templates; not of templates that drop
    the reasoning of earlier turns, such as Qwen3's).

    Raises:
        ValueError: the template renders an earlier turn differently from the last.
    """
    full = render(tokenizer, messages, tools, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        opened = render(tokenizer, messages[:i], tools, add_generation_prompt=True)
        closed = render(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
        end = len(closed)
        while end > len(opened) and not tokenizer.decode(closed[end - 1 : end]).strip():
            end -= 1
        if full[: len(opened)] != opened or closed[:end] != full[:end] or end <= len(opened):
            raise ValueError(
                f"messages[{i}]: the chat template renders this assistant turn differently in "
                "the whole conversation than as its last turn; per-token weights cannot be "
                "taken from it"
            )
        spans.append((len(opened), end))
    return spans


def assistant_weights(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[list[int], list[float]]:
    """The rendered conversation's token ids and a weight per token: 1.0 on the model's own
    tokens (`assistant_spans`), 0.0 elsewhere."""
    tokens = render(tokenizer, messages, tools, add_generation_prompt=False)
    weights = [0.0] * len(tokens)
    for start, end in assistant_spans(tokenizer, messages, tools):
        weights[start:end] = [1.0] * (end - start)
    return tokens, weights
