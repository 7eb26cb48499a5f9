"""The Anthropic Messages surface through the real `anthropic` package against the served
platform: a message and a stream from a live session's sampler weights and from a sampler
checkpoint, with text, stop_reason and usage equal to the tinker SDK's `sample` (same seed) of
the chat template's tokens (system prompt as a string and as blocks); count_tokens equal to the
input_tokens a message is metered with (the tenant's prefill usage), a prefill included; the wire
events in Anthropic's order (key as x-api-key); a stop sequence; refusals in Anthropic's error
shape (no key, another tenant's model, a missing max_tokens, tools, an image); top_k and top_p
reach the sampler (keeping one token is the greedy text)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import Platform, new_tenant_key
from treadle.platform.models import tokenizers

pytestmark = [pytest.mark.compat, pytest.mark.integration]

BASE_MODEL = "treadle/tiny-debug"
SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "Say hi"}]
MAX_TOKENS = 6
# anthropic 2.x's create() has no sampling parameters (newer Claude models fix them): clients
# that still send them, as older SDKs and agent harnesses do, put them in the body.
GREEDY = {"temperature": 0.0}
SEEDED = {"seed": 4321}  # Treadle's extension: a tiny random model's greedy text is newlines


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    return new_tenant_key(platform, "anthropic")


@pytest.fixture(scope="module")
def service(platform: Platform, key: str) -> Iterator[tinker.ServiceClient]:
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    yield svc
    svc.close("success").result()


@pytest.fixture(scope="module")
def trained(service: tinker.ServiceClient) -> tuple[str, tinker.SamplingClient, str]:
    """(live session id, its sampling client, a sampler checkpoint's path)."""
    tc = service.create_lora_training_client(BASE_MODEL, rank=4, seed=5).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    path = tc.save_weights_for_sampler("anthropic-ckpt").result().path
    return tc.model_id, sampler, path


def _client(platform: Platform, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"{platform.base_url}/anthropic/api", api_key=key, max_retries=0
    )


@pytest.fixture(scope="module")
def client(platform: Platform, key: str) -> anthropic.Anthropic:
    return _client(platform, key)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The catalogue's tokenizer, built into a cache folder of this module's own."""
    return tokenizers.load_tokenizer(BASE_MODEL, Path(tmp_path_factory.mktemp("tokenizers")))


def _chat_tokens(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def _sdk(sampler: tinker.SamplingClient, tokens: list[int]) -> types.SampledSequence:
    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=SEEDED["seed"])
    return sampler.sample(types.ModelInput.from_ints(tokens), 1, params).result().sequences[0]


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
@pytest.mark.parametrize("source", ["live session", "checkpoint"])
def test_a_message_equals_the_sdks_sample(
    service, trained, client, tok, source: str, stream: bool
) -> None:
    session, live, path = trained
    model, sdk = (session, live) if source == "live session" else (
        path, service.create_sampling_client(model_path=path).result())  # fmt: skip
    # the system prompt as a string for the live session, as two text blocks for the checkpoint
    system: Any = SYSTEM if source == "live session" else [
        {"type": "text", "text": "You are"}, {"type": "text", "text": "terse."}]  # fmt: skip
    joined = SYSTEM if source == "live session" else "You are\n\nterse."
    prompt = _chat_tokens(tok, [{"role": "system", "content": joined}, *MESSAGES])
    expected = _sdk(sdk, prompt)
    args: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "system": system,
                            "messages": MESSAGES, "extra_body": SEEDED}  # fmt: skip
    if stream:
        with client.messages.stream(**args) as events:
            text = "".join(events.text_stream)
            message = events.get_final_message()
        assert message.content[0].text == text
    else:
        message = client.messages.create(**args)
    assert message.model == model and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == tok.decode(list(expected.tokens), skip_special_tokens=True)
    stopped = expected.stop_reason == "stop"
    assert message.stop_reason == ("end_turn" if stopped else "max_tokens")
    assert message.stop_sequence is None
    assert message.usage.input_tokens == len(prompt)
    assert message.usage.output_tokens == len(expected.tokens)


def _prefill_tokens(platform: Platform, key: str, since: datetime) -> int:
    hour = "%Y-%m-%dT%H:00:00Z"
    window = {
        "since": f"{since:{hour}}",
        "until": f"{datetime.now(UTC) + timedelta(hours=1):{hour}}",
    }
    usage = httpx.get(f"{platform.base_url}/api/v1/treadle/usage", params=window,
                      headers={"X-API-Key": key}, timeout=30).json()["total"]  # fmt: skip
    return int(usage["prefill_tokens"])


def test_count_tokens_equals_the_metered_input_tokens(platform: Platform, tok) -> None:
    key = new_tenant_key(platform, "anthropic")  # a tenant of its own: its usage is this test's
    client, since = _client(platform, key), datetime.now(UTC)
    system = [{"type": "text", "text": SYSTEM}]
    counted = client.messages.count_tokens(model=BASE_MODEL, system=system, messages=MESSAGES)
    message = client.messages.create(model=BASE_MODEL, max_tokens=3, system=system,
                                     messages=MESSAGES)  # fmt: skip
    expected = _chat_tokens(tok, [{"role": "system", "content": SYSTEM}, *MESSAGES])
    assert counted.input_tokens == message.usage.input_tokens == len(expected)
    assert _prefill_tokens(platform, key, since) == len(expected)
    # a final assistant message is a prefill: the reply continues its text
    prefill = [*MESSAGES, {"role": "assistant", "content": "Hi, I am"}]
    open_turn = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    continued = tok.encode(open_turn + "Hi, I am", add_special_tokens=False)
    counted = client.messages.count_tokens(model=BASE_MODEL, messages=prefill)
    assert counted.input_tokens == len(continued)
    # an empty tools list asks for no tool: served as without one
    counted = client.messages.count_tokens(model=BASE_MODEL, messages=MESSAGES, tools=[])
    assert counted.input_tokens == len(_chat_tokens(tok, MESSAGES))


def test_the_wire_events_are_anthropics_in_order(platform: Platform, trained, key) -> None:
    """The raw stream, the key sent as x-api-key: event names and their data's types."""
    _, _, path = trained
    body = {"model": path, "max_tokens": MAX_TOKENS, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{platform.base_url}/anthropic/api/v1/messages", json=body,
                      headers={"x-api-key": key}, timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in data] == names
    deltas = names[3:-3]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert deltas and set(deltas) == {"content_block_delta"}
    assert all(d["delta"]["type"] == "text_delta" for d in data[3:-3])
    assert data[0]["message"]["usage"]["output_tokens"] == 0
    assert data[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert 0 < data[-2]["usage"]["output_tokens"] <= MAX_TOKENS


def test_a_stop_sequence_ends_the_text_before_it(client) -> None:
    args: dict[str, Any] = {"model": BASE_MODEL, "max_tokens": 12, "messages": MESSAGES,
                            "extra_body": SEEDED}  # fmt: skip
    text = client.messages.create(**args).content[0].text
    stop = text[len(text) // 2 :][:3]  # a piece from its second half
    assert stop.strip(), text
    cut = client.messages.create(**args, stop_sequences=["never-seen", stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[: text.index(stop)]


def _refusal(caught: pytest.ExceptionInfo[anthropic.APIStatusError]) -> tuple[int, str, str]:
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    return caught.value.status_code, body["error"]["type"], body["error"]["message"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools are not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
         "messages.0.content.0.type: image inputs are not supported"),
        ({"temperature": 1.5}, "temperature: Input should be less than or equal to 1"),
        ({"frequency_penalty": 1}, "frequency_penalty: Extra inputs are not permitted"),
        ({"messages": [*MESSAGES, {"role": "assistant", "content": "Hi "}]},
         "final assistant content cannot end with trailing whitespace"),
    ],
    ids=["no max_tokens", "tools", "image", "temperature", "unknown field", "prefill space"],
)  # fmt: skip
def test_a_bad_request_is_a_400_saying_what_is_wrong(platform, key, change, says) -> None:
    body = {"model": BASE_MODEL, "max_tokens": 4, "messages": MESSAGES} | change
    body = {name: value for name, value in body.items() if value is not None}
    response = httpx.post(f"{platform.base_url}/anthropic/api/v1/messages", json=body,
                          headers={"x-api-key": key}, timeout=30)  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert says in error["error"]["message"]


def test_another_tenants_model_and_no_key_are_refused(platform: Platform, trained) -> None:
    session, _, path = trained
    other = _client(platform, new_tenant_key(platform, "anthropic"))
    for model in (session, path):
        with pytest.raises(anthropic.NotFoundError) as caught:
            other.messages.create(model=model, max_tokens=2, messages=MESSAGES)
        assert _refusal(caught)[:2] == (404, "not_found_error")
    response = httpx.post(f"{platform.base_url}/anthropic/api/v1/messages", timeout=30,
                          json={"model": BASE_MODEL, "max_tokens": 2, "messages": MESSAGES})  # fmt: skip
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and "x-api-key" in error["message"]


@pytest.mark.parametrize("narrow", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k", "top_p"])
def test_top_k_1_or_a_tiny_top_p_samples_the_greedy_text(client, narrow) -> None:
    """At temperature 1, keeping only the likeliest token is the greedy answer."""
    args: dict[str, Any] = {"model": BASE_MODEL, "max_tokens": 8, "messages": MESSAGES}
    greedy = client.messages.create(**args, extra_body=GREEDY).content[0].text
    sampled = [client.messages.create(**args, extra_body=narrow).content[0].text
               for _ in range(2)]  # fmt: skip
    assert sampled == [greedy, greedy]
