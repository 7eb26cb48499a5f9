"""Anthropic Messages bodies (api/anthropic/schemas.py): what becomes the chat template's
messages (system first, text blocks joined with a blank line, a final assistant turn a prefill
unless empty), and each refusal's message naming the field and what to do."""

from __future__ import annotations

from typing import Any

import pytest

from treadle.api.anthropic import schemas
from treadle.platform.errors import ValidationError

USER = {"role": "user", "content": "Say hi"}


def _parse(**fields: Any) -> schemas.MessagesRequest:
    return schemas.parse(schemas.MessagesRequest, {"model": "m", "max_tokens": 4} | fields)


def test_system_and_text_blocks_become_template_messages() -> None:
    body = _parse(
        system=[{"type": "text", "text": "You are"}, {"type": "text", "text": "terse."}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "b"}]}],
    )  # fmt: skip
    assert body.chat() == [
        {"role": "system", "content": "You are\n\nterse."},
        {"role": "user", "content": "a\n\nb"},
    ]
    assert not body.is_prefill


def test_a_final_assistant_turn_is_a_prefill_unless_empty() -> None:
    prefill = _parse(messages=[USER, {"role": "assistant", "content": "Hi, I"}])
    assert prefill.is_prefill and prefill.chat()[-1] == {"role": "assistant", "content": "Hi, I"}
    empty = _parse(messages=[USER, {"role": "assistant", "content": ""}])
    assert not empty.is_prefill and empty.chat() == [USER]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"messages": [USER], "max_tokens": None}, "max_tokens: Field required"),
        ({"messages": [USER], "tools": [{"name": "f"}]}, "tools: tools are not supported"),
        ({"messages": [USER], "thinking": {"type": "enabled"}},
         "thinking: extended thinking is not supported"),
        ({"messages": [USER], "system": [{"type": "image"}]},
         "system.0.type: image inputs are not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
         "messages.0.content.0.type: tools are not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
         "messages.0.content.0.type: document inputs are not supported"),
        ({"messages": [USER], "stop_sequences": [""]}, None),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role: Input should be"),
        ({"messages": []}, "messages: List should have at least 1 item"),
        ({"messages": [USER], "top_k": 0}, "top_k: Input should be greater than or equal to 1"),
        ({"messages": [USER], "logprobs": True}, "logprobs: Extra inputs are not permitted"),
        ({"messages": [USER, {"role": "assistant", "content": "x\n"}]},
         "final assistant content cannot end with trailing whitespace"),
        ({"messages": [{"role": "user", "content": "a\x00"}]}, "NUL"),
    ],
)  # fmt: skip
def test_a_bad_body_is_refused_saying_what_is_wrong(
    fields: dict[str, Any], says: str | None
) -> None:
    body = {k: v for k, v in ({"model": "m", "max_tokens": 4} | fields).items() if v is not None}
    with pytest.raises(ValidationError) as caught:
        schemas.parse(schemas.MessagesRequest, body).stops()
    assert caught.value.status == 400
    assert (says or "stop_sequences: each stop sequence must be a non-empty string") in str(
        caught.value.message
    )


def test_empty_tool_fields_ask_for_nothing() -> None:
    body = schemas.parse(schemas.CountTokensRequest,
                         {"model": "m", "messages": [USER], "tools": [], "tool_choice": None})  # fmt: skip
    assert body.chat() == [USER]
