"""Tool calls in the model's own chat format (treadle.client.tool_calls), on SmolLM2's tokenizer:
its own template (no tool support: the generic format) and Qwen2.5's tool template set on it."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.chat_templates import QWEN25_TOOLS_TEMPLATE  # noqa: E402
from treadle.client import tool_calls  # noqa: E402
from treadle.client.tool_calls import (  # noqa: E402
    HERMES,
    ToolCall,
    ToolCallParseError,
    ToolFormatError,
)
from treadle.platform.models.tokenizers import load_tokenizer  # noqa: E402

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# A user question, a tool call, its result, the answer, a second question answered with text
# and a call together.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Sunny, 21 C."},
    {"role": "user", "content": "And Oslo?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
            }
        ],
    },
]
# What the model itself writes in each assistant turn, through either template.
OWN_TURNS = [
    CALL_TEXT + "<|im_end|>",
    "Sunny, 21 C.<|im_end|>",
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    "</tool_call><|im_end|>",
]


@pytest.fixture(scope="module")
def smol(cache_dir: Path) -> Any:
    return load_tokenizer(SMOLLM2, cache_dir)


@pytest.fixture(scope="module")
def qwen_style(cache_dir: Path) -> Any:
    tok = load_tokenizer(SMOLLM2, cache_dir)
    tok.chat_template = QWEN25_TOOLS_TEMPLATE
    return tok


def test_smollm2_template_has_no_tool_support_and_qwen_template_has(
    smol: Any, qwen_style: Any
) -> None:
    assert not tool_calls.template_supports_tools(smol)
    assert tool_calls.template_supports_tools(qwen_style)
    assert tool_calls.tool_call_format(smol) == tool_calls.tool_call_format(qwen_style) == HERMES


def test_generic_format_lists_tools_in_the_system_message_and_results_as_a_user_turn(
    smol: Any,
) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "b", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "snow"},
    ]
    text = tool_calls.render_text(smol, messages, [WEATHER], add_generation_prompt=True)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n# Tools\n")  # SmolLM2's default prompt replaced
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system
    assert "<tool_call></tool_call> XML tags" in system
    assert rest == (
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL_TEXT}\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nsnow\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tool_calls.render(smol, messages, [WEATHER], add_generation_prompt=True) == smol.encode(
        text, add_special_tokens=False
    )


def test_generic_format_appends_the_tools_to_a_system_message(smol: Any) -> None:
    text = tool_calls.render_text(smol, CONVERSATION[:2], [WEATHER], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou answer briefly.\n\n# Tools\n")
    without_tools = tool_calls.render_text(smol, CONVERSATION[:2], add_generation_prompt=True)
    assert without_tools == smol.apply_chat_template(
        CONVERSATION[:2], add_generation_prompt=True, tokenize=False
    )


def test_tool_template_renders_the_conversation_with_arguments_as_objects(
    qwen_style: Any,
) -> None:
    text = tool_calls.render_text(qwen_style, CONVERSATION, [WEATHER], add_generation_prompt=False)
    expected = copy.deepcopy(CONVERSATION)
    expected[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    expected[2]["content"] = ""
    assert text == qwen_style.apply_chat_template(
        expected, tools=[WEATHER], add_generation_prompt=False, tokenize=False
    )
    assert CALL_TEXT in text and "You are Qwen" not in text  # our system message kept
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text


@pytest.mark.parametrize("template", ["generic", "qwen2.5"])
def test_weights_cover_exactly_the_models_own_tokens(
    template: str, smol: Any, qwen_style: Any
) -> None:
    """Token by token: a token has weight 1 exactly when its characters lie in one of the
    assistant turns' own text (content, calls, end-of-turn token), found in the rendered text
    independently of the module."""
    tok = smol if template == "generic" else qwen_style
    tokens, weights = tool_calls.assistant_weights(tok, CONVERSATION, [WEATHER])
    text = tool_calls.render_text(tok, CONVERSATION, [WEATHER], add_generation_prompt=False)
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert tokens == encoded["input_ids"]
    regions, cursor = [], 0
    for own in OWN_TURNS:
        start = text.index("<|im_start|>assistant\n" + own, cursor) + len("<|im_start|>assistant\n")
        regions.append((start, start + len(own)))
        cursor = start + len(own)
    for i, (begin, end) in enumerate(encoded["offset_mapping"]):
        inside = any(lo <= begin and end <= hi for lo, hi in regions)
        assert weights[i] == (1.0 if inside else 0.0), (i, tok.decode(tokens[i : i + 1]))
    spans = tool_calls.assistant_spans(tok, CONVERSATION, [WEATHER])
    assert [tok.decode(tokens[s:e]) for s, e in spans] == OWN_TURNS
    assert sum(weights) == sum(e - s for s, e in spans)


def test_spans_are_refused_when_the_template_renders_earlier_turns_differently(
    smol: Any, cache_dir: Path
) -> None:
    tok = load_tokenizer(SMOLLM2, cache_dir)
    # drops the text of every assistant turn but the last, as reasoning templates drop thoughts
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match=r"messages\[2\].*renders this assistant turn"):
        tool_calls.assistant_spans(tok, CONVERSATION[:5], [WEATHER])


def test_sampled_text_parses_into_its_text_and_calls() -> None:
    text, calls = tool_calls.parse_tool_calls(
        HERMES,
        f"Let me look.\n{CALL_TEXT}\n"
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
    )
    assert text == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert tool_calls.parse_tool_calls(HERMES, "  Just text.\n") == ("Just text.", [])


def test_a_rendered_turn_parses_back_to_its_calls(smol: Any) -> None:
    tokens = tool_calls.render(smol, CONVERSATION, [WEATHER], add_generation_prompt=False)
    start, end = tool_calls.assistant_spans(smol, CONVERSATION, [WEATHER])[2]
    sampled = smol.decode(tokens[start:end], skip_special_tokens=True)
    text, calls = tool_calls.parse_tool_calls(smol, sampled, tools=[WEATHER])
    assert text == "Let me look."
    assert calls[0].to_openai()["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }


@pytest.mark.parametrize(
    ("sampled", "message"),
    [
        ('<tool_call>\n{"name": "get_weather"', "tool call 1: <tool_call> is never closed"),
        ("done</tool_call>", "</tool_call> without a <tool_call> before it"),
        ("<tool_call>{name: get_weather}</tool_call>", "tool call 1: not valid JSON"),
        ('<tool_call>["get_weather"]</tool_call>', "must be a JSON object with a name"),
        ('<tool_call>{"arguments": {}}</tool_call>', "has no function name"),
        (
            '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
            "'arguments' must be a JSON object",
        ),
        (
            f'{CALL_TEXT}<tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>',
            "tool call 2: calls 'get_time', which is not one of the tools ['get_weather']",
        ),
        ("<tool_call><tool_call>{}</tool_call>", "opened again before </tool_call>"),
    ],
)
def test_unreadable_call_is_an_error_saying_what_is_wrong(sampled: str, message: str) -> None:
    with pytest.raises(ToolCallParseError) as info:
        tool_calls.parse_tool_calls(HERMES, sampled, tools=[WEATHER])
    assert message in str(info.value)


def test_template_with_another_call_format_is_not_parsed(cache_dir: Path) -> None:
    tok = load_tokenizer(SMOLLM2, cache_dir)
    tok.chat_template = (
        "{{ tools | tojson }}{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]"
        "{{ m.tool_calls | tojson }}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    assert tool_calls.template_supports_tools(tok)
    with pytest.raises(ToolFormatError, match="other than Hermes"):
        tool_calls.parse_tool_calls(tok, "[TOOL_CALLS][]")


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ({"type": "function"}, "tools must be a list"),
        ([{"type": "code_interpreter"}], "tools[0]: each tool must be an object with type"),
        ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
        ([WEATHER, WEATHER], "tools[1].function.name: 'get_weather' is declared twice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "none"}}],
            "tools[0].function.parameters: must be a JSON Schema object",
        ),
    ],
)
def test_malformed_tools_are_refused_saying_where(tools: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        tool_calls.validate_tools(tools)
    assert message in str(info.value)


def test_malformed_call_in_a_message_is_refused_saying_where(smol: Any) -> None:
    bad = copy.deepcopy(CONVERSATION[:3])
    bad[2]["tool_calls"][0]["function"]["arguments"] = "{city: Paris}"
    with pytest.raises(ValueError, match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments"):
        tool_calls.render(smol, bad, [WEATHER], add_generation_prompt=False)


def test_tool_call_is_an_openai_tool_calls_entry() -> None:
    call = ToolCall(id="call_9", name="get_weather", arguments={"city": "Zürich"})
    assert call.to_openai() == {
        "id": "call_9",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Z\\u00fcrich"}'},
    }
