"""Tools in OpenAI chat requests (treadle.api.chat): what a request may carry and how a sampled
reply becomes `tool_calls`, without a platform."""

from __future__ import annotations

import json
from typing import Any

import pytest

from treadle.api.chat.answers import Calls, HeldCalls
from treadle.api.chat.schemas import ChatCompletionRequest, ParamError, parse
from treadle.api.chat.serving import _prefill

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _request(**fields: Any) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"model": "m", "messages": [USER], **fields})


def test_a_conversation_with_calls_and_results_is_accepted() -> None:
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "developer", "content": "Be brief."},
    ]  # fmt: skip
    body = parse(ChatCompletionRequest, {"model": "m", "messages": messages, "tools": [WEATHER]})
    plain = [m.plain() for m in body.messages]
    assert plain[1] == {"role": "assistant", "tool_calls": messages[1]["tool_calls"]}
    assert plain[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert plain[3]["role"] == "system"
    assert body.offered_tools() == [WEATHER]


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ({"role": "tool", "content": "sunny"}, "only a tool message, carries tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c1"}, "carries tool_call_id"),
        ({"role": "assistant"}, "content is required"),
        (
            {
                "role": "user",
                "content": "x",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
            },
            "only assistant messages carry tool_calls",
        ),
    ],  # fmt: skip
)
def test_a_message_not_shaped_for_its_role_is_a_400(message: dict[str, Any], says: str) -> None:
    with pytest.raises(ParamError) as info:
        parse(ChatCompletionRequest, {"model": "m", "messages": [message]})
    assert info.value.param == "messages.0" and says in info.value.message


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tools": [{"type": "function"}]}, "tools", "tools[0].function: must be an object"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "declared twice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "names function 'x', which is not among the tools ['get_weather']",
        ),
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "invalid parameter"),
    ],
)
def test_bad_tools_or_tool_choice_are_400s_naming_them(
    fields: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(ParamError) as info:
        _request(**fields).offered_tools()
    assert info.value.param == param and says in info.value.message


def test_tool_choice_none_offers_no_tools() -> None:
    assert _request(tools=[WEATHER], tool_choice="none").offered_tools() == []
    assert _request(tools=[]).offered_tools() == []


def test_a_reply_with_calls_answers_tool_calls() -> None:
    message, finish = Calls([WEATHER]).message(f"Let me look.\n{CALL}", "stop")
    assert finish == "tool_calls" and message["content"] == "Let me look."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_reply_without_a_readable_call_answers_its_text() -> None:
    for text in ("It is sunny.", "<tool_call>\n{not json}\n</tool_call>"):
        message, finish = Calls([WEATHER]).message(text, "length")
        assert (message["content"], finish) == (text, "length")
        assert "tool_calls" not in message


def test_the_prefill_of_tool_choice_opens_the_call() -> None:
    named = parse(ChatCompletionRequest, {"model": "m", "messages": [USER], "tools": [WEATHER],
                  "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})  # fmt: skip
    prefill = _prefill(named.tool_choice)
    assert CALL.startswith(prefill) and prefill.endswith('"arguments":')
    required = _prefill("required")
    assert CALL.startswith(required) and required.endswith('"name": "')
    assert _prefill("auto") == _prefill(None) == ""
    message, finish = Calls([WEATHER], prefill).message(CALL.removeprefix(prefill), "stop")
    assert finish == "tool_calls" and message["content"] is None


def test_parallel_tool_calls_false_answers_the_first_call() -> None:
    second = CALL.replace("Paris", "Oslo")
    message, _ = Calls([WEATHER], parallel=False).message(CALL + second, "stop")
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": "Paris"}
    ]


def _streamed(hold: HeldCalls, pieces: list[str], finish: str) -> tuple[list[str], Any]:
    sent = [hold.feed(piece) for piece in pieces]
    return sent, hold.end(finish)


def test_a_streamed_reply_holds_its_text_from_where_a_call_may_begin() -> None:
    text = f"Let me look.\n{CALL}"
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # the mark comes in pieces
    sent, (rest, calls, finish) = _streamed(HeldCalls(Calls([WEATHER])), pieces, "stop")
    assert "".join(sent) == "Let me look.\n"  # nothing of the call went out as content
    assert (rest, finish) == ("", "tool_calls")
    [call] = calls
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert call["id"].startswith("call_") and call["type"] == "function"


def test_a_streamed_reply_without_a_call_streams_all_its_text() -> None:
    pieces = ["It is <", "b>sunny</b> and <tool", "_cal"]  # a mark that never completes
    sent, (rest, calls, finish) = _streamed(HeldCalls(Calls([WEATHER])), pieces, "length")
    assert "".join(sent) + rest == "".join(pieces)
    assert sent[0] == "It is " and (calls, finish) == ([], "length")
    text = "<tool_call>\n{not json}\n</tool_call>"  # a call that cannot be read: its text
    sent, (rest, calls, finish) = _streamed(HeldCalls(Calls([WEATHER])), [text], "stop")
    assert (sent, rest, calls, finish) == ([""], text, [], "stop")


def test_a_streamed_reply_that_tool_choice_opens_holds_everything() -> None:
    prefill = _prefill("required")
    sent, (rest, calls, finish) = _streamed(
        HeldCalls(Calls([WEATHER], prefill)), [CALL.removeprefix(prefill)], "stop"
    )
    assert sent == [""] and rest == "" and finish == "tool_calls"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
