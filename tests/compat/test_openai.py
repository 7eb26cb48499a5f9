"""The OpenAI-compatible routes through the real `openai` package against the served platform:
completions and chat completions from a live session's sampler weights and from a sampler
checkpoint, streamed and not, with tokens and logprobs equal to the tinker SDK's `sample` for
the same prompt tokens and seed; /v1/models lists the caller's live session and checkpoint and
no other tenant's; another tenant's model is a NotFoundError, an unsupported parameter a
BadRequestError naming it, a request without a key a 401 in OpenAI's error format; Tinker's
documented path /oai/api/v1 answers exactly as /v1."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.conftest import Platform
from treadle.client.admin import AdminClient
from treadle.platform.models import tokenizers

pytestmark = [pytest.mark.compat, pytest.mark.integration]

BASE_MODEL = "treadle/tiny-debug"
PROMPT = "The capital of France is"
SEED = 1234


def _tenant(platform: Platform) -> str:
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"openai-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    return str(key)


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    return _tenant(platform)


@pytest.fixture(scope="module")
def service(platform: Platform, key: str) -> Iterator[tinker.ServiceClient]:
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    yield svc
    svc.close("success").result()


@pytest.fixture(scope="module")
def trained(
    service: tinker.ServiceClient,
) -> tuple[tinker.TrainingClient, tinker.SamplingClient, str]:
    tc = service.create_lora_training_client(BASE_MODEL, rank=4, seed=3).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    path = tc.save_weights_for_sampler("openai-ckpt").result().path
    return tc, sampler, path


@pytest.fixture(scope="module")
def client(platform: Platform, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The catalogue's tokenizer, built into a cache folder of this module's own."""
    return tokenizers.load_tokenizer(BASE_MODEL, Path(tmp_path_factory.mktemp("tokenizers")))


def _sdk(sampler: tinker.SamplingClient, tokens: list[int], n: int) -> types.SampledSequence:
    params = types.SamplingParams(max_tokens=n, temperature=1.0, seed=SEED)
    return sampler.sample(types.ModelInput.from_ints(tokens), 1, params).result().sequences[0]


def test_completion_from_a_live_session_equals_the_sdk_sample(trained, client, tok) -> None:
    tc, sampler, _ = trained
    answer = client.completions.create(
        model=tc.model_id, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=SEED, logprobs=2
    )
    expected = _sdk(sampler, tok.encode(PROMPT, add_special_tokens=False), 8)
    got = tok.convert_tokens_to_ids(answer.choices[0].logprobs.tokens)
    assert got == list(expected.tokens)
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert answer.usage.completion_tokens == len(expected.tokens)


def test_streamed_chat_from_a_checkpoint_equals_the_whole_answer(trained, client) -> None:
    _, _, path = trained
    messages = [{"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(
        model=path, messages=messages, max_tokens=6, seed=SEED, logprobs=True, top_logprobs=2
    )
    stream = client.chat.completions.create(
        model=path,
        messages=messages,
        max_tokens=6,
        seed=SEED,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.content]  # fmt: skip
    content = whole.choices[0].logprobs.content
    assert [lp.token for lp in streamed] == [lp.token for lp in content]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in content])
    assert all(len(lp.top_logprobs) == 2 for lp in streamed)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("source", ["live session", "checkpoint"])
def test_every_route_and_source_equals_the_sdk_sample(
    service, trained, client, tok, source: str, route: str, stream: bool
) -> None:
    tc, live, path = trained
    model, sdk = (tc.model_id, live) if source == "live session" else (
        path, service.create_sampling_client(model_path=path).result())  # fmt: skip
    common: dict[str, Any] = {"model": model, "max_tokens": 6, "temperature": 1.0, "seed": SEED}
    if route == "chat":
        messages = [{"role": "user", "content": "Say hi"}]
        prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                            tokenize=False), add_special_tokens=False)  # fmt: skip
        answer = client.chat.completions.create(messages=messages, logprobs=True, stream=stream,
                                                **common)  # fmt: skip
    else:
        prompt = tok.encode(PROMPT, add_special_tokens=False)
        answer = client.completions.create(prompt=PROMPT, logprobs=1, stream=stream, **common)
    choices = [c.choices[0] for c in answer if c.choices] if stream else [answer.choices[0]]
    text = "".join((c.delta.content or "") if route == "chat" and stream else
                   c.message.content if route == "chat" else c.text for c in choices)  # fmt: skip
    if route == "chat":
        logprobs = [lp.logprob for c in choices if c.logprobs for lp in c.logprobs.content]
    else:
        logprobs = [lp for c in choices if c.logprobs for lp in c.logprobs.token_logprobs]
    expected = _sdk(sdk, list(prompt), 6)
    assert text == tok.decode(list(expected.tokens), skip_special_tokens=True)
    assert logprobs == pytest.approx(expected.logprobs, abs=1e-5)


def test_another_tenants_model_is_not_found(platform: Platform, trained) -> None:
    tc, _, path = trained
    other = openai.OpenAI(base_url=f"{platform.base_url}/v1", api_key=_tenant(platform))
    for model in (tc.model_id, path):
        with pytest.raises(openai.NotFoundError):
            other.completions.create(model=model, prompt=PROMPT, max_tokens=2)


def test_an_unsupported_parameter_is_a_bad_request_naming_it(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=BASE_MODEL, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
        )  # fmt: skip
    assert caught.value.body["param"] == "response_format"


def test_models_lists_the_callers_session_and_checkpoint_only(platform: Platform, trained,
                                                               client) -> None:  # fmt: skip
    tc, _, path = trained
    mine = {m.id for m in client.models.list()}
    assert {tc.model_id, path, BASE_MODEL} <= mine
    other = openai.OpenAI(base_url=f"{platform.base_url}/v1", api_key=_tenant(platform))
    theirs = {m.id for m in other.models.list()}
    assert BASE_MODEL in theirs and not {tc.model_id, path} & theirs


def test_a_request_without_a_key_is_a_401_in_openais_format(platform: Platform) -> None:
    response = httpx.post(f"{platform.base_url}/v1/completions", json={"model": BASE_MODEL,
                          "prompt": PROMPT}, timeout=30)  # fmt: skip
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in error["message"]


def test_tinkers_oai_path_answers_exactly_as_v1(platform: Platform, trained, client,
                                                key: str) -> None:  # fmt: skip
    """Tinker's documented base URL, <server>/oai/api/v1: the same completions (whole and
    streamed, from the live session and the checkpoint), model list and errors as /v1."""
    tc, _, path = trained
    oai = openai.OpenAI(base_url=f"{platform.base_url}/oai/api/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "Say hi"}]
    chats = [c.chat.completions.create(model=tc.model_id, messages=messages, max_tokens=6,
                                       seed=SEED, logprobs=True) for c in (client, oai)]  # fmt: skip
    assert chats[0].choices[0].message.content == chats[1].choices[0].message.content
    assert [lp.logprob for lp in chats[0].choices[0].logprobs.content] == pytest.approx(
        [lp.logprob for lp in chats[1].choices[0].logprobs.content], abs=1e-6)  # fmt: skip
    texts = [c.completions.create(model=path, prompt=PROMPT, max_tokens=6, seed=SEED)
             .choices[0].text for c in (client, oai)]  # fmt: skip
    streamed = oai.completions.create(model=path, prompt=PROMPT, max_tokens=6, seed=SEED,
                                      stream=True)  # fmt: skip
    assert texts[0] == texts[1] == "".join(c.choices[0].text for c in streamed if c.choices)
    assert {m.id for m in oai.models.list()} == {m.id for m in client.models.list()}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=path, prompt=PROMPT, max_tokens=2, echo=True)
    assert caught.value.body["param"] == "echo"
    refusals = [httpx.post(f"{platform.base_url}{prefix}/completions", timeout=30,
                           json={"model": BASE_MODEL, "prompt": PROMPT})
                for prefix in ("/v1", "/oai/api/v1")]  # fmt: skip
    assert [r.status_code for r in refusals] == [401, 401]
    assert refusals[0].json() == refusals[1].json()
