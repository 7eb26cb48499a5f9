"""Streamed samples against a real Redis and the engine in process, stepped as the session host
steps them (`streaming.Streams` around `engine.SampleBatch`): a streamed request's published
messages add up to its final tokens and logprobs, one step at a time; an unmarked request
publishes nothing; a cancelled one leaves the batch at the next step while its neighbour's
result equals its solo run; `follow` ends on the done notice, on `is_done`, or with a timeout;
Redis being down changes no result."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from engine_support import PROMPT, TINY

from tests.conftest import Services
from treadle.engine import Engine, SampleRequest, SampleResult, SamplingSpec
from treadle.platform.errors import OperationCancelledError
from treadle.platform.eventlog import notify, progress
from treadle.platform.eventlog.progress import ProgressTimeoutError
from treadle.worker.streaming import Streams

SHORT_PROMPT = [1, 300, 17]


@pytest.fixture(scope="module")
def client(services: Services) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(services.redis_url)
    yield c
    c.close()


def _rid() -> str:
    return "req-test-" + secrets.token_hex(6)


class _Flag:
    """A request's interrupt, as `running.Running.check`: raises once it is cancelled."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def __call__(self) -> None:
        if self.reason is not None:
            raise OperationCancelledError(self.reason)


def _run(
    engine: Engine,
    client: redis.Redis,
    requests: dict[str, SampleRequest],
    flags: dict[str, _Flag],
    cancel_after: dict[str, int] | None = None,
) -> tuple[dict[str, SampleResult | Exception], dict[str, int]]:
    """Decode `requests` together as `SessionHost._run_samples` does: (results, the step at
    which each finished). `cancel_after`: request -> the step after which its client cancels."""
    batch = engine.open_batch(TINY)
    streams = Streams(client)
    for rid in streams.join([(rid, r.num_samples) for rid, r in requests.items()]):
        flags[rid].reason = progress.CANCELLED_MESSAGE
    results: dict[str, SampleResult | Exception] = {}
    ended: dict[str, int] = {}
    finished = batch.add(list(requests.items()))
    streams.after_step(batch, finished)
    step = 0
    while len(batch):
        finished = batch.step()
        step += 1
        for rid, when in (cancel_after or {}).items():
            if when == step:
                progress.cancel_streamed(client, rid)
        for rid in streams.after_step(batch, finished):
            flags[rid].reason = progress.CANCELLED_MESSAGE
        for key, out in finished:
            results[str(key)], ended[str(key)] = out, step
            notify.publish_done(client, str(key))  # the host does, once settled
    return results, ended


def _request(prompt: list[int], n: int, spec: SamplingSpec, flag: _Flag) -> SampleRequest:
    return SampleRequest(TINY, None, prompt, n, spec, interrupt=flag)


def test_published_tokens_add_up_to_the_final_tokens(engine: Engine, client: redis.Redis) -> None:
    streamed, plain = _rid(), _rid()
    flags = {streamed: _Flag(), plain: _Flag()}
    requests = {
        streamed: _request(
            PROMPT, 2, SamplingSpec(max_tokens=9, temperature=1.0, seed=4), flags[streamed]
        ),
        plain: _request(SHORT_PROMPT, 1, SamplingSpec(max_tokens=5, seed=1), flags[plain]),
    }
    progress.want_progress(client, streamed)
    with (
        progress.follow(client, streamed, timeout_seconds=10) as f,
        progress.follow(client, plain, timeout_seconds=10) as g,
    ):
        results, _ = _run(engine, client, requests, flags)
        messages = list(f)
        assert list(g) == []  # unmarked: nothing published, the done notice ends it
    out = results[streamed]
    assert isinstance(out, SampleResult)
    for i, seq in enumerate(out.sequences):
        mine = [m for m in messages if m["sample"] == i]
        # one message per decoding step, each with that step's token
        assert [len(m["tokens"]) for m in mine] == [1] * len(seq.tokens)
        assert [t for m in mine for t in m["tokens"]] == seq.tokens
        np.testing.assert_allclose(
            [v for m in mine for v in m["logprobs"]], seq.logprobs, atol=0, rtol=0
        )
    assert len(out.sequences[0].tokens) > 0


def test_a_cancelled_stream_leaves_at_the_next_step(engine: Engine, client: redis.Redis) -> None:
    doomed, neighbour = _rid(), _rid()
    flags = {doomed: _Flag(), neighbour: _Flag()}
    spec = SamplingSpec(max_tokens=20, temperature=1.0, seed=9, stop=())
    requests = {
        doomed: _request(PROMPT, 2, spec, flags[doomed]),
        neighbour: _request(
            SHORT_PROMPT, 2, SamplingSpec(max_tokens=12, seed=2, stop=()), flags[neighbour]
        ),
    }
    progress.want_progress(client, doomed)
    progress.want_progress(client, neighbour)  # streamed too: its result must not change
    with progress.follow(client, doomed, timeout_seconds=10) as f:
        results, ended = _run(engine, client, requests, flags, cancel_after={doomed: 3})
        messages = list(f)
    out = results[doomed]
    assert isinstance(out, OperationCancelledError)
    assert out.code == "cancelled" and out.message == "cancelled: the client disconnected"
    assert ended[doomed] == 4  # cancelled after step 3: gone at the step after
    assert sorted((m["sample"], len(m["tokens"])) for m in messages) == [(0, 1)] * 3 + [(1, 1)] * 3
    solo_flag = _Flag()
    (alone,) = engine.sample_batch(
        [_request(SHORT_PROMPT, 2, requests[neighbour].params, solo_flag)]
    )
    batched = results[neighbour]
    assert isinstance(alone, SampleResult) and isinstance(batched, SampleResult)
    for one, other in zip(alone.sequences, batched.sequences, strict=True):
        assert one.tokens == other.tokens
        np.testing.assert_allclose(one.logprobs, other.logprobs, atol=1e-5, rtol=0)


def test_a_request_cancelled_before_it_joins_never_decodes(
    engine: Engine, client: redis.Redis
) -> None:
    rid = _rid()
    flags = {rid: _Flag()}
    progress.want_progress(client, rid)
    progress.cancel_streamed(client, rid)
    requests = {rid: _request(PROMPT, 1, SamplingSpec(max_tokens=8, seed=1), flags[rid])}
    results, ended = _run(engine, client, requests, flags)
    assert isinstance(results[rid], OperationCancelledError)
    assert ended[rid] == 1


def test_follow_ends_on_is_done_or_times_out(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "RECHECK_SECONDS", 0.1)
    asked: list[int] = []

    def done() -> bool:  # a lost done notice: the database says it is settled
        asked.append(1)
        return len(asked) >= 2

    with progress.follow(client, _rid(), timeout_seconds=5, is_done=done) as f:
        assert list(f) == []
    assert len(asked) == 2
    with (
        progress.follow(client, _rid(), timeout_seconds=0.3) as f,
        pytest.raises(ProgressTimeoutError) as caught,
    ):
        list(f)
    assert caught.value.status == 504
    with pytest.raises(RuntimeError, match="enter the Follow"):
        list(progress.follow(client, _rid(), timeout_seconds=1))


def test_redis_down_changes_no_result(engine: Engine) -> None:
    down = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    flags = {"a": _Flag()}
    request = _request(PROMPT, 1, SamplingSpec(max_tokens=6, seed=3), flags["a"])
    batch = engine.open_batch(TINY)
    streams = Streams(down)
    assert streams.join([("a", 1)]) == [] and len(streams) == 0
    results = dict(batch.add([("a", request)]))
    while len(batch):
        results.update(batch.step())
    (alone,) = engine.sample_batch([request])
    out = results["a"]
    assert isinstance(out, SampleResult) and isinstance(alone, SampleResult)
    assert out.sequences[0].tokens == alone.sequences[0].tokens


def test_tokens_unsent_while_redis_is_down_go_with_the_next_step(
    engine: Engine, client: redis.Redis
) -> None:
    rid = _rid()
    request = _request(PROMPT, 1, SamplingSpec(max_tokens=8, seed=6, stop=()), _Flag())
    progress.want_progress(client, rid)
    batch = engine.open_batch(TINY)
    streams = Streams(client)
    assert streams.join([(rid, 1)]) == []
    results = dict(batch.add([(rid, request)]))
    down = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    with progress.follow(client, rid, timeout_seconds=10) as f:
        step = 0
        while len(batch):
            finished = batch.step()
            step += 1
            streams._redis = down if step in (2, 3) else client  # Redis away for two steps
            assert streams.after_step(batch, finished) == []
            results.update(finished)
        notify.publish_done(client, rid)
        messages = list(f)
    out = results[rid]
    assert isinstance(out, SampleResult)
    assert step >= 4, "the sample must outlast the outage"
    assert [len(m["tokens"]) for m in messages][:2] == [1, 3]  # steps 2 and 3 came with step 4
    assert [t for m in messages for t in m["tokens"]] == out.sequences[0].tokens
