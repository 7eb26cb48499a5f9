"""A streamed sample on a running platform (`treadle up`, two workers): a sample of a tiny-debug
sampler, admitted through the platform's own `commands.submit` and marked as streamed inside its
admission transaction (as the API's streaming routes do), publishes its tokens while it decodes;
`follow` reads them; `cancel_streamed` stops it within a couple of seconds (failed, code
"cancelled"), the worker's `treadle_operations_in_flight` gauge goes back to 0, and a plain
sample of the same sampler decoding beside it returns what it returns alone."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis
import sqlalchemy as sa
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tests.conftest import Platform
from treadle.client.admin import AdminClient
from treadle.platform import db
from treadle.platform.config import PlatformConfig
from treadle.platform.eventlog import optypes, progress
from treadle.platform.operations import commands, operations
from treadle.platform.sessions import routing
from treadle.platform.tenancy import keys
from treadle.platform.tenancy.tenants import Principal

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
PROMPT = [1, 504, 3575, 282]


@dataclass(frozen=True)
class Streaming:
    deps: commands.Deps
    principal: Principal
    sampler: tinker.SamplingClient
    sampler_id: str
    session_id: str


@pytest.fixture(scope="module")
def streaming(platform: Platform) -> Iterator[Streaming]:
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"streamed-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    sampler = svc.create_sampling_client(base_model=BASE_MODEL).result()
    sampler.sample(  # the sampler's session is leased and its model loaded
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2, seed=1)
    ).result()
    engine = db.connect(platform.database_url, pool_size=2)
    client = redis.Redis.from_url(platform.redis_url)
    with engine.connect() as conn:
        principal = keys.authenticate(conn, key)
        sampler_id, session_id = conn.execute(
            sa.text("SELECT id, session_id FROM samplers WHERE tenant_id = :t"),
            {"t": principal.tenant_id},
        ).one()
    deps = commands.Deps(
        db=engine,
        celery=routing.make_celery(platform.redis_url),
        redis=client,
        config=PlatformConfig.from_env({"DATABASE_URL": platform.database_url}),
    )
    yield Streaming(deps, principal, sampler, sampler_id, session_id)
    client.close()
    engine.dispose()
    svc.close("success").result()


def _in_flight(s: Streaming) -> float:
    """`treadle_operations_in_flight` summed over the workers, from their own endpoints."""
    with s.deps.db.connect() as conn:
        urls = [
            i["metrics_url"] for i in conn.execute(sa.text("SELECT info FROM workers")).scalars()
        ]
    total = 0.0
    for url in urls:
        text = httpx.get(url, timeout=10).text
        for family in text_string_to_metric_families(text):
            total += sum(
                s.value for s in family.samples if s.name == "treadle_operations_in_flight"
            )
    return total


def _operation(s: Streaming, request_id: str) -> operations.OperationRow:
    with s.deps.db.connect() as conn:
        return operations.get_operation(conn, None, request_id)


def test_a_streamed_sample_publishes_and_is_cancelled_promptly(streaming: Streaming) -> None:
    s = streaming
    payload = optypes.Sample(
        prompt=PROMPT,
        snapshot_id=None,
        checkpoint_prefix=None,
        num_samples=1,
        prompt_logprobs=False,
        params=optypes.SamplingParams(max_tokens=2000, temperature=1.0, seed=5, stop=[]),
    )
    follower = progress.follow(s.deps.redis, "", timeout_seconds=60)

    def mark(admission: operations.Admission) -> None:  # before commit: no worker sees it yet
        progress.want_progress(s.deps.redis, admission.request_id)
        follower.request_id = admission.request_id
        follower.__enter__()

    seq_id = 1_000_000 + secrets.randbelow(1_000_000)
    admission = commands.submit(
        s.deps, s.principal, s.session_id, seq_id, payload, sampler_id=s.sampler_id,
        on_admitted=mark,
    )  # fmt: skip
    request_id = admission.request_id
    neighbour_params = types.SamplingParams(max_tokens=24, temperature=1.0, seed=11, stop=[])
    with follower:
        messages = []
        for message in follower:
            messages.append(message)
            if len(messages) == 2:  # it is decoding: a neighbour joins the batch
                neighbour = s.sampler.sample(
                    types.ModelInput.from_ints(PROMPT[:3]), 1, neighbour_params
                )
            if len(messages) == 30:
                break
        assert _in_flight(s) >= 1
        cancelled_at = time.monotonic()
        progress.cancel_streamed(s.deps.redis, request_id)
        for message in follower:  # ends with the done notice
            messages.append(message)
    settled_in = time.monotonic() - cancelled_at
    op = _operation(s, request_id)
    assert op.status == "failed"
    assert op.error == {
        "category": "user",
        "code": "cancelled",
        "message": "cancelled: the client disconnected",
    }
    assert settled_in < 2.0, settled_in
    assert all(m["sample"] == 0 and len(m["tokens"]) == 1 for m in messages)
    assert 30 <= len(messages) < 2000
    # the neighbour went on, its result what it gets alone
    beside = neighbour.result().sequences[0]
    alone = s.sampler.sample(types.ModelInput.from_ints(PROMPT[:3]), 1, neighbour_params)
    alone_seq = alone.result().sequences[0]
    assert beside.tokens == alone_seq.tokens
    assert beside.logprobs == pytest.approx(alone_seq.logprobs, abs=1e-5)
    deadline = time.monotonic() + 5
    while _in_flight(s) != 0:
        assert time.monotonic() < deadline, "the worker still counts an operation in flight"
        time.sleep(0.1)
