"""Batching changes no result: a request sampled alone and inside a mixed batch (other adapters
and ranks, other prompt lengths, other max_tokens, rows that stop early) returns the same tokens
and logprobs within 1e-5; one request's error or interruption never fails its neighbours."""

from __future__ import annotations

import numpy as np
import pytest
from engine_support import PROMPT, TINY, new_adapter, randomise_b

from treadle.engine import (
    Engine,
    LoraSpec,
    SampleRequest,
    SampleResult,
    SamplingSpec,
)
from treadle.engine.losses.functions import MICROBATCH_LOGITS
from treadle.engine.sampling.prompt_scores import PromptScoring
from treadle.platform.errors import NotFoundError, OperationCancelledError

LONG_PROMPT = [1, 9690, 198, 2683, 359, 253, 42, 77, 1001, 5, 600, 12]
SHORT_PROMPT = [1, 300, 17]


@pytest.fixture(scope="module")
def snapshots(engine: Engine) -> tuple[str, str]:
    """Two snapshots of different adapters, of different ranks, both unlike the base model."""
    ids = []
    for n, rank in enumerate((4, 8)):
        adapter = new_adapter(engine, LoraSpec(rank=rank, alpha=16.0, seed=n))
        randomise_b(engine, adapter, seed=10 + n, std=0.2)
        engine.snapshot(adapter, f"batch-snap-{n}")
        ids.append(f"batch-snap-{n}")
    return ids[0], ids[1]


def _stop_string(engine: Engine, request: SampleRequest) -> str:
    """A stop string that ends `request`'s first sequence after its second token."""
    (out,) = engine.sample_batch([request])
    assert isinstance(out, SampleResult)
    tokens = out.sequences[0].tokens
    assert len(tokens) >= 3, "the probe must sample at least 3 tokens"
    text = str(engine.tokenizer(TINY).decode(tokens[:2]))
    assert text.strip(), "the first two tokens must decode to some text"
    return text


def _mixed(engine: Engine, snapshots: tuple[str, str]) -> list[SampleRequest]:
    a, b = snapshots
    seeded = SamplingSpec(max_tokens=8, temperature=1.0, seed=7, stop=())
    stopping = SampleRequest(TINY, b, SHORT_PROMPT, 1, SamplingSpec(max_tokens=9, seed=5, stop=()))
    stop = _stop_string(engine, stopping)
    return [
        SampleRequest(TINY, a, PROMPT, 2, seeded, topk_sample_logprobs=3),
        SampleRequest(
            TINY,
            b,
            LONG_PROMPT,
            1,
            SamplingSpec(max_tokens=5, temperature=0.0, stop=()),
            PromptScoring(logprobs=True, topk=2),
        ),
        SampleRequest(
            TINY,
            None,
            SHORT_PROMPT,
            3,
            SamplingSpec(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3, stop=()),
        ),
        SampleRequest(TINY, b, SHORT_PROMPT, 1, SamplingSpec(max_tokens=9, seed=5, stop=(stop,))),
        SampleRequest(
            TINY, a, LONG_PROMPT[:7], 1, SamplingSpec(max_tokens=0, seed=11), PromptScoring(alt_k=2)
        ),
    ]


def _assert_same(alone: SampleResult, batched: SampleResult, prompt_rtol: float = 0.0) -> None:
    assert len(alone.sequences) == len(batched.sequences)
    for one, other in zip(alone.sequences, batched.sequences, strict=True):
        assert one.tokens == other.tokens
        assert one.stop_reason == other.stop_reason
        np.testing.assert_allclose(one.logprobs, other.logprobs, atol=1e-5, rtol=0)
        assert (one.topk_logprobs is None) == (other.topk_logprobs is None)
        if one.topk_logprobs is not None and other.topk_logprobs is not None:
            for mine, theirs in zip(one.topk_logprobs, other.topk_logprobs, strict=True):
                assert [t for t, _ in mine] == [t for t, _ in theirs]
                np.testing.assert_allclose([v for _, v in mine], [v for _, v in theirs], atol=1e-5)
    lp_alone = [np.nan if v is None else v for v in alone.prompt_logprobs or []]
    lp_batched = [np.nan if v is None else v for v in batched.prompt_logprobs or []]
    np.testing.assert_allclose(lp_alone, lp_batched, atol=1e-5, rtol=prompt_rtol)
    assert alone.prompt_alt_tokens == batched.prompt_alt_tokens
    assert (alone.prefill_tokens, alone.sample_tokens) == (
        batched.prefill_tokens,
        batched.sample_tokens,
    )


def test_request_alone_equals_inside_a_mixed_batch(
    engine: Engine, snapshots: tuple[str, str]
) -> None:
    requests = _mixed(engine, snapshots)
    batched = engine.sample_batch(requests)
    for request, out in zip(requests, batched, strict=True):
        (alone,) = engine.sample_batch([request])
        assert isinstance(alone, SampleResult) and isinstance(out, SampleResult)
        _assert_same(alone, out)
    stopped = batched[3]
    assert isinstance(stopped, SampleResult)
    assert stopped.sequences[0].stop_reason == "stop"
    assert len(stopped.sequences[0].tokens) < 9


def test_batch_order_does_not_change_results(engine: Engine, snapshots: tuple[str, str]) -> None:
    requests = _mixed(engine, snapshots)
    forward = engine.sample_batch(requests)
    backward = engine.sample_batch(requests[::-1])[::-1]
    for one, other in zip(forward, backward, strict=True):
        assert isinstance(one, SampleResult) and isinstance(other, SampleResult)
        _assert_same(one, other)


def test_adapters_in_one_batch_differ_from_each_other(
    engine: Engine, snapshots: tuple[str, str]
) -> None:
    """Precondition of the equality tests: each row really runs its own adapter."""
    greedy = SamplingSpec(max_tokens=0)
    score = PromptScoring(logprobs=True)
    outs = engine.sample_batch(
        [SampleRequest(TINY, s, LONG_PROMPT, 1, greedy, score) for s in (*snapshots, None)]
    )
    lps = [tuple(o.prompt_logprobs or []) for o in outs if isinstance(o, SampleResult)]
    assert len(set(lps)) == 3


def test_a_bad_request_fails_alone(engine: Engine, snapshots: tuple[str, str]) -> None:
    good = SampleRequest(TINY, snapshots[0], PROMPT, 1, SamplingSpec(max_tokens=4, seed=1))
    missing = SampleRequest(TINY, "no-such-snapshot", PROMPT, 1, SamplingSpec(max_tokens=4))
    out_good, out_missing = engine.sample_batch([good, missing])
    assert isinstance(out_missing, NotFoundError)
    (alone,) = engine.sample_batch([good])
    assert isinstance(out_good, SampleResult) and isinstance(alone, SampleResult)
    _assert_same(alone, out_good)


def test_an_interrupted_request_ends_alone(engine: Engine, snapshots: tuple[str, str]) -> None:
    calls = []

    def cancel_on_third_step() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise OperationCancelledError("stopped")

    spec = SamplingSpec(max_tokens=8, seed=2, stop=())
    good = SampleRequest(TINY, snapshots[1], SHORT_PROMPT, 2, spec)
    doomed = SampleRequest(TINY, snapshots[0], PROMPT, 1, spec, interrupt=cancel_on_third_step)
    out_doomed, out_good = engine.sample_batch([doomed, good])
    assert isinstance(out_doomed, OperationCancelledError)
    (alone,) = engine.sample_batch([good])
    assert isinstance(out_good, SampleResult) and isinstance(alone, SampleResult)
    _assert_same(alone, out_good)


def test_requests_joining_and_leaving_a_running_batch_match_alone(
    engine: Engine, snapshots: tuple[str, str]
) -> None:
    """Continuous batching: jobs join after other jobs have decoded some steps (so their cache
    rows are shorter or longer than the running ones) and leave when done (so padding columns
    are cropped); each job's tokens and logprobs are what it gets alone."""
    requests = _mixed(engine, snapshots)
    joins_at = {0: [0, 1], 2: [2], 4: [3], 6: [4]}  # step -> requests joining before it
    batch = engine.open_batch(TINY)
    results: dict[object, object] = {}
    step = 0
    while step <= max(joins_at) or len(batch):
        for i in joins_at.get(step, []):
            results.update(batch.add([(i, requests[i])]))
        results.update(batch.step())
        step += 1
    assert sorted(results) == list(range(len(requests)))
    for i, request in enumerate(requests):
        (alone,) = engine.sample_batch([request])
        out = results[i]
        assert isinstance(alone, SampleResult) and isinstance(out, SampleResult)
        _assert_same(alone, out)


def test_rows_in_equal_runs_of_different_adapters_match_alone(
    engine: Engine, snapshots: tuple[str, str]
) -> None:
    """Every row runs an adapter, in runs of equal length (the path that needs no gather):
    alternating adapters and ranks, two samples each, prompts of different lengths."""
    prompts = [PROMPT, SHORT_PROMPT, LONG_PROMPT, LONG_PROMPT[:5]]
    requests = [
        SampleRequest(TINY, snapshots[i % 2], prompt, 2, SamplingSpec(max_tokens=6, seed=i))
        for i, prompt in enumerate(prompts)
    ]
    for request, out in zip(requests, engine.sample_batch(requests), strict=True):
        (alone,) = engine.sample_batch([request])
        assert isinstance(alone, SampleResult) and isinstance(out, SampleResult)
        _assert_same(alone, out)


def test_long_scored_prompts_prefill_in_passes_bounded_by_their_logits(
    engine: Engine, snapshots: tuple[str, str]
) -> None:
    """Prompts scored whole keep every position's logits: 6 of 300 tokens would hold 1,800 x
    49,152 floats in one pass, so they prefill in groups within MICROBATCH_LOGITS, and each
    still equals its request alone. Prompt logprobs of 300 positions summed through differently
    shaped matmuls differ in float32's last bits: within 1e-5 or 2e-6 of their size (about 16
    ulps; the random tiny model puts them near -12)."""
    a, b = snapshots
    rng = np.random.default_rng(3)
    scored = PromptScoring(logprobs=True, topk=2)
    requests = [
        SampleRequest(TINY, (a, b, None)[i % 3], [int(t) for t in rng.integers(1, 49_000, 300)],
                      1, SamplingSpec(max_tokens=3, temperature=1.0, seed=i, stop=()), scored)
        for i in range(6)
    ]  # fmt: skip
    batch = engine.open_batch(TINY)
    jobs = [(i, engine._reference_job(r)) for i, r in enumerate(requests)]
    groups = batch._decoding._prefill_groups(jobs)
    vocab = engine.tokenizer(TINY).vocab_size
    assert [len(g) for g in groups] == [2, 2, 2]  # 2 x 300 x vocab fits, 3 x 300 does not
    assert all(len(g) * 300 * vocab <= MICROBATCH_LOGITS for g in groups)
    for request, out in zip(requests, engine.sample_batch(requests), strict=True):
        (alone,) = engine.sample_batch([request])
        assert isinstance(alone, SampleResult) and isinstance(out, SampleResult)
        _assert_same(alone, out, prompt_rtol=2e-6)
