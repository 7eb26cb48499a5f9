"""How the OpenAI-compatible routes serve, through the real `openai` package (and httpx where a
client must hang up) against the served platform, on a tenant of this module's own sampling
the base model: a completion is metered on the tenant's usage as its prompt (prefill) and
completion (sample) tokens; `n` choices equal the tinker SDK's `num_samples` for the same seed;
a stop string ends the text before it with finish_reason "stop", `max_tokens` with "length";
concurrent requests get seq_ids of their own; a client that disconnects mid-stream frees its
place in the engine (the operation fails "cancelled", the workers' in-flight gauge drops to 0).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tests.conftest import Platform
from treadle.client.admin import AdminClient
from treadle.platform import db
from treadle.platform.models import tokenizers
from treadle.platform.tenancy import keys

pytestmark = [pytest.mark.compat, pytest.mark.integration]

BASE_MODEL = "treadle/tiny-debug"
PROMPT = "Once upon a time"
SEED = 77


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"openai-serving-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    return str(key)


@pytest.fixture(scope="module")
def client(platform: Platform, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The catalogue's tokenizer, built into a cache folder of this module's own."""
    return tokenizers.load_tokenizer(BASE_MODEL, Path(tmp_path_factory.mktemp("tokenizers")))


@pytest.fixture(scope="module")
def engine(platform: Platform) -> Iterator[sa.Engine]:
    eng = db.connect(platform.database_url, pool_size=2)
    yield eng
    eng.dispose()


@pytest.fixture(scope="module")
def tenant(engine: sa.Engine, key: str) -> str:
    with engine.connect() as conn:
        return keys.authenticate(conn, key).tenant_id


def _hour(value: datetime) -> str:
    return f"{value.replace(minute=0, second=0, microsecond=0):%Y-%m-%dT%H:%M:%SZ}"


def test_a_completion_is_metered_as_its_prompt_and_completion_tokens(
    platform: Platform, client: openai.OpenAI, key: str
) -> None:
    before = datetime.now(UTC)
    answer = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=7, seed=SEED)
    window = {"since": _hour(before), "until": _hour(datetime.now(UTC) + timedelta(hours=1))}
    usage = httpx.get(
        f"{platform.base_url}/api/v1/treadle/usage", params=window,
        headers={"X-API-Key": key}, timeout=30,
    ).json()["total"]  # fmt: skip
    assert answer.usage is not None
    assert usage["prefill_tokens"] == answer.usage.prompt_tokens > 0
    assert usage["sample_tokens"] == answer.usage.completion_tokens > 0


def test_n_choices_equal_the_sdks_num_samples(
    platform: Platform, client: openai.OpenAI, key: str, tok: Any
) -> None:
    answer = client.completions.create(
        model=BASE_MODEL, prompt=PROMPT, max_tokens=6, seed=SEED, n=3, logprobs=0
    )
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    sampler = svc.create_sampling_client(base_model=BASE_MODEL).result()
    prompt = types.ModelInput.from_ints(tok.encode(PROMPT, add_special_tokens=False))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=SEED)
    expected = sampler.sample(prompt, 3, params).result().sequences
    svc.close("success").result()
    got = [tok.convert_tokens_to_ids(c.logprobs.tokens) for c in answer.choices]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert got == [list(s.tokens) for s in expected]


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=12, seed=SEED)
    text = whole.choices[0].text
    stop = text[len(text) // 2 :][:3]  # a piece from its second half
    assert stop.strip(), text
    cut = client.completions.create(
        model=BASE_MODEL, prompt=PROMPT, max_tokens=12, seed=SEED, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_max_tokens_reached_is_finish_reason_length(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=BASE_MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=5, seed=SEED
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 5


def test_concurrent_requests_get_seq_ids_of_their_own(
    client: openai.OpenAI, engine: sa.Engine, tenant: str
) -> None:
    def one(seed: int) -> Any:
        return client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=3, seed=seed)

    def served() -> int:
        with engine.connect() as conn:
            return int(conn.execute(
                sa.text("SELECT count(DISTINCT (sampler_id, seq_id)) FROM operations "
                        "WHERE tenant_id = :t AND sampler_id LIKE '%:openai:%'"), {"t": tenant},
            ).scalar_one())  # fmt: skip

    before = served()
    with ThreadPoolExecutor(8) as pool:  # a shared seq_id would refuse or merge requests
        answers = list(pool.map(one, range(100, 108)))
    assert len({a.choices[0].text for a in answers}) > 1
    assert served() == before + 8


def _in_flight(engine: sa.Engine) -> float:
    """`treadle_operations_in_flight` summed over the workers, from their own endpoints."""
    with engine.connect() as conn:
        urls = [
            i["metrics_url"] for i in conn.execute(sa.text("SELECT info FROM workers")).scalars()
        ]
    total = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            total += sum(
                s.value for s in family.samples if s.name == "treadle_operations_in_flight"
            )
    return total


def test_a_client_that_disconnects_mid_stream_frees_its_place(
    platform: Platform, key: str, engine: sa.Engine, tenant: str
) -> None:
    body = {"model": BASE_MODEL, "prompt": PROMPT, "max_tokens": 2000, "seed": SEED,
            "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{platform.base_url}/v1/completions", json=body,
                      headers=headers, timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:  # it is decoding
                assert _in_flight(engine) >= 1
                break  # and the client hangs up
    closed_at = time.monotonic()
    with engine.connect() as conn:
        request_id = conn.execute(
            sa.text("SELECT request_id FROM operations WHERE tenant_id = :t "
                    "ORDER BY created_at DESC LIMIT 1"), {"t": tenant},
        ).scalar_one()  # fmt: skip
    while True:
        with engine.connect() as conn:
            status, error = conn.execute(
                sa.text("SELECT status, error FROM operations WHERE request_id = :r"),
                {"r": request_id},
            ).one()
        if status != "pending" and _in_flight(engine) == 0:
            break
        assert time.monotonic() - closed_at < 5, (status, error)
        time.sleep(0.1)
    assert status == "failed", status
    assert error["code"] == "cancelled" and "disconnected" in error["message"], error


def test_a_stopped_sampling_session_is_replaced_on_the_next_request(
    platform: Platform, client: openai.OpenAI, key: str, engine: sa.Engine, tenant: str
) -> None:
    client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=2, seed=SEED)
    with engine.connect() as conn:
        serving = conn.execute(
            sa.text("SELECT id FROM sessions WHERE tenant_id = :t AND id LIKE '%:openai:%' "
                    "AND status IN ('Created', 'Running')"), {"t": tenant},
        ).scalars().all()  # fmt: skip
    for session_id in serving:  # its tenant stops it (or its worker failed it)
        stopped = httpx.post(f"{platform.base_url}/api/v1/treadle/sessions/{session_id}/stop",
                             headers={"X-API-Key": key}, timeout=30)  # fmt: skip
        assert stopped.status_code == 200, stopped.text
    answer = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=2, seed=SEED)
    assert answer.choices[0].finish_reason in ("stop", "length")
