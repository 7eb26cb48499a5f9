"""Tools through the real `openai` package against the served platform, on a registered model
whose chat template renders tools (SmolLM2-135M-Instruct's weights with Qwen2.5's tool
template, in the Hermes `<tool_call>` format). Its adapter is trained on one conversation
whose reply is a call, with weight only on the reply's own tokens
(`treadle.client.tool_calls.assistant_weights`); greedy chats from the live session then answer that call as `tool_calls` (finish_reason
"tool_calls"), for tool_choice "auto", "required" and the named function, streamed or not
(streamed: the call whole in the last chunk); "none" answers text. Malformed tools and a
tool_choice naming an unknown function are 400s naming the parameter."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from tests.chat_templates import QWEN25_TOOLS_TEMPLATE
from tests.conftest import Platform
from treadle.client import tool_calls
from treadle.client.admin import AdminClient
from treadle.engine.models import loading
from treadle.platform.config import DEFAULT_CACHE_DIR
from treadle.platform.models.catalog import SMOLLM2_NAME as SMOLLM2
from treadle.platform.models.catalog import get_base_model

pytestmark = [pytest.mark.compat, pytest.mark.integration, pytest.mark.slow]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, CLOCK]
QUESTION = [{"role": "user", "content": "What time is it?"}]
REPLY = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_time", "arguments": "{}"},
        }
    ],
}
STEPS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a registrable folder (its weights converted from the GGUF,
    linked) with Qwen2.5's tool template in place of its own. The conversion is the served
    platform's own cache's (made once per machine, as its workers make it)."""
    cache = Path(os.environ.get("TREADLE_CACHE_DIR") or DEFAULT_CACHE_DIR)
    served = loading.serving_dir(get_base_model(SMOLLM2), cache)
    folder = tmp_path_factory.mktemp("tool-model") / "smollm2-tools"
    tok = AutoTokenizer.from_pretrained(str(served))
    tok.chat_template = QWEN25_TOOLS_TEMPLATE
    tok.save_pretrained(str(folder))
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (served / name).exists():
            (folder / name).symlink_to((served / name).resolve())
    return folder


@pytest.fixture(scope="module")
def model(platform: Platform, folder: Path) -> str:
    name = f"tools-{secrets.token_hex(3)}/smollm2"
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        admin.register_model(name, path=str(folder), max_lora_rank=16)
    finally:
        admin.close()
    return name


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        return str(admin.create_tenant(f"openai-tools-{secrets.token_hex(3)}")["api_key"])
    finally:
        admin.close()


@pytest.fixture(scope="module")
def session(platform: Platform, key: str, model: str, folder: Path) -> Iterator[str]:
    """A live session trained to answer QUESTION with REPLY's call: its model id."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tool_calls.template_supports_tools(tok)
    tokens, weights = tool_calls.assistant_weights(tok, [*QUESTION, REPLY], TOOLS)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
    )
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    tc = svc.create_lora_training_client(model, rank=8, seed=5).result()
    for _ in range(STEPS):  # queued in order; only the last is awaited
        loss = tc.forward_backward([datum], "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=2e-3))
    step.result()
    assert loss.result().metrics["loss:sum"] < 0.1  # the reply is learnt
    tc.save_weights_and_get_sampling_client().result()
    yield tc.model_id
    svc.close("success").result()


@pytest.fixture(scope="module")
def client(platform: Platform, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform.base_url}/v1", api_key=key, max_retries=0)


def _chat(client: openai.OpenAI, session: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=session, messages=QUESTION, max_tokens=40, temperature=0.0, **extra
    )


@pytest.mark.parametrize(
    "tool_choice",
    ["auto", "required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["auto", "required", "named"],
)
def test_the_trained_call_comes_back_as_tool_calls(
    client: openai.OpenAI, session: str, tool_choice: Any
) -> None:
    choice = _chat(client, session, tools=TOOLS, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {}


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_streamed_chat_with_tools_ends_with_the_same_answer(
    client: openai.OpenAI, session: str, tool_choice: str
) -> None:
    whole = _chat(client, session, tools=TOOLS, tool_choice=tool_choice).choices[0]
    content, calls, finish = "", [], None
    for chunk in _chat(client, session, tools=TOOLS, tool_choice=tool_choice, stream=True):
        [choice] = chunk.choices
        content += choice.delta.content or ""
        calls += choice.delta.tool_calls or []
        finish = choice.finish_reason or finish
    assert finish == whole.finish_reason
    assert content == (whole.message.content or "")
    expected = whole.message.tool_calls or []
    assert [c.index for c in calls] == list(range(len(expected)))
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in expected
    ]
    assert calls  # the trained call, whole in the last chunk


def test_tool_choice_none_answers_text(client: openai.OpenAI, session: str) -> None:
    choice = _chat(client, session, tools=TOOLS, tool_choice="none").choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert not choice.message.tool_calls and isinstance(choice.message.content, str)


def test_a_conversation_with_the_call_and_its_result_is_served(
    client: openai.OpenAI, session: str
) -> None:
    messages = [
        *QUESTION,
        REPLY,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=session, messages=messages, tools=TOOLS, max_tokens=4, temperature=0.0
    )
    assert answer.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0].function.name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ],
    ids=["malformed tool", "unknown function", "choice without tools"],
)
def test_bad_tool_requests_are_400s_naming_the_parameter(
    client: openai.OpenAI, session: str, extra: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, session, **extra)
    error = info.value.body
    assert error["param"] == param and message in error["message"]
