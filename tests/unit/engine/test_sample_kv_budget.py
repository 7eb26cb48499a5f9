"""The sampler's KV budget (sampling/kv_pool.py): a prompt's keys and values are written once for
all of its samples; the pool is allocated once and written in place; jobs beyond the budget
wait, in order, and join when room frees, never holding more than the budget; a job added while
the batch decodes joins at the next step; one larger than the whole budget runs alone. Every job's tokens and logprobs are still those it gets alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.architectures import build
from treadle.engine import Engine, SampleRequest, SampleResult, SamplingSpec
from treadle.engine.lora.adapters import LoraHost
from treadle.engine.sampling.decode import DecodeBatch, SampleJob, generate_batch
from treadle.engine.sampling.kv_pool import kv_need
from treadle.platform.errors import OperationCancelledError
from treadle.platform.models.catalog import TINY_DEBUG_NAME

PROMPT = list(range(3, 23))  # 20 tokens


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, LoraHost]:
    model = build("llama3")
    return model, LoraHost(model)


def _batch(llama: tuple[torch.nn.Module, LoraHost], kv_tokens: int) -> DecodeBatch:
    model, host = llama
    return DecodeBatch(model, host, eos_token_id=None, decode=lambda ids: "", kv_tokens=kv_tokens)


def _job(samples: int, max_tokens: int, seed: int, prompt: list[int] = PROMPT) -> SampleJob:
    return SampleJob(prompt, samples, SamplingSpec(max_tokens=max_tokens, seed=seed, stop=()))


def _alone(llama: tuple[torch.nn.Module, LoraHost], job: SampleJob) -> SampleResult:
    model, host = llama
    (out,) = generate_batch(model, host, [job], eos_token_id=None, decode=lambda ids: "")
    assert isinstance(out, SampleResult)
    return out


def _assert_same(alone: SampleResult, out: object) -> None:
    assert isinstance(out, SampleResult)
    for one, other in zip(alone.sequences, out.sequences, strict=True):
        assert one.tokens == other.tokens
        np.testing.assert_allclose(one.logprobs, other.logprobs, atol=1e-5, rtol=0)


def test_a_prompt_is_cached_once_for_all_its_samples(
    llama: tuple[torch.nn.Module, LoraHost],
) -> None:
    batch = _batch(llama, 1000)
    batch.add([("a", _job(8, 6, seed=1))])
    assert batch.rows == 8
    assert batch.kv.in_use == len(PROMPT)  # not 8 x 20: the samples read one copy
    batch.step()
    assert batch.kv.in_use == len(PROMPT) + 8  # each sample's first token, its own
    assert batch.kv.reserved == kv_need(len(PROMPT), 8, 6) == 20 + 8 * 5


def test_the_pool_is_allocated_once_and_written_in_place(
    llama: tuple[torch.nn.Module, LoraHost],
) -> None:
    batch = _batch(llama, 500)
    batch.add([("a", _job(4, 12, seed=2))])
    layer = batch.kv.layers[0]
    assert layer.keys is not None and layer.values is not None
    where = (layer.keys.data_ptr(), layer.values.data_ptr())
    allocated = batch.kv.nbytes()
    heads, head_dim = 2, 8  # tests/architectures.py's sizes: 2 kv heads of 32 / 4
    assert allocated == 2 * 2 * (500 + 1) * heads * head_dim * 4  # 2 layers x K and V, float32
    batch.add([("b", _job(2, 5, seed=3, prompt=PROMPT[:7]))])  # joins: nothing is copied
    while len(batch):
        batch.step()
        assert (layer.keys.data_ptr(), layer.values.data_ptr()) == where
        assert batch.kv.nbytes() == allocated
    assert batch.kv.in_use == 0 and batch.kv.reserved == 0


def test_jobs_beyond_the_budget_wait_and_join_when_room_frees(
    llama: tuple[torch.nn.Module, LoraHost],
) -> None:
    jobs = [_job(4, 10, seed=10 + n) for n in range(3)]
    need = kv_need(len(PROMPT), 4, 10)  # 56
    batch = _batch(llama, 2 * need + 10)  # two jobs fit, not three
    results = dict(batch.add(list(enumerate(jobs))))
    assert batch.waiting == [2] and batch.rows == 8
    assert batch.drawn(2) == ([[], [], [], []], [[], [], [], []])
    joined_at = None
    while len(batch):
        results.update(batch.step())
        assert batch.kv.reserved <= batch.kv.tokens
        if joined_at is None and not batch.waiting:
            joined_at = batch.steps
    assert joined_at == 11  # it decodes from the step after the first two finished (10)
    assert batch.kv.peak <= batch.kv.tokens
    assert batch.kv.peak == 2 * need  # every slot used: the two jobs' prompts and tokens
    for n, job in enumerate(jobs):
        _assert_same(_alone(llama, job), results[n])


def test_a_job_added_while_the_batch_decodes_joins_at_the_next_step(
    llama: tuple[torch.nn.Module, LoraHost],
) -> None:
    long, short = _job(2, 40, seed=4), _job(3, 4, seed=5, prompt=PROMPT[:9])
    batch = _batch(llama, 1000)
    results = dict(batch.add([("long", long)]))
    for _ in range(5):
        results.update(batch.step())
    results.update(batch.add([("short", short)]))
    assert batch.rows == 2 + 3  # its rows decode from the next step on
    finished_at = {}
    while len(batch):
        for key, out in batch.step():
            finished_at[key], results[key] = batch.steps, out
    assert finished_at == {"short": 5 + 4, "long": 40}
    _assert_same(_alone(llama, long), results["long"])
    _assert_same(_alone(llama, short), results["short"])


def test_a_job_over_the_whole_budget_runs_alone_after_the_others(
    llama: tuple[torch.nn.Module, LoraHost],
) -> None:
    """A job needing more than the whole budget waits until nothing else holds any KV, runs
    alone in a pool of its own size (those behind it wait), and the budget's pool comes back."""
    first, big, after = _job(2, 10, seed=6), _job(8, 12, seed=7), _job(1, 3, seed=8)
    batch = _batch(llama, 100)
    assert kv_need(len(PROMPT), 8, 12) == 108
    results = dict(batch.add([("first", first), ("big", big), ("after", after)]))
    assert batch.waiting == ["big", "after"]
    ran_alone = False
    while len(batch):
        results.update(batch.step())
        assert batch.kv.reserved <= batch.kv.tokens
        if "big" in batch._states:
            ran_alone = True
            assert "first" not in batch and batch.waiting == ["after"]
            assert batch.kv.tokens == 108
    assert ran_alone
    assert batch.kv.tokens == batch.kv.budget == 100
    for key, job in (("first", first), ("big", big), ("after", after)):
        _assert_same(_alone(llama, job), results[key])


def test_a_waiting_job_can_be_cancelled(llama: tuple[torch.nn.Module, LoraHost]) -> None:
    def cancelled() -> None:
        raise OperationCancelledError("cancelled by its client")

    running = _job(1, 6, seed=8)
    waiting = SampleJob(PROMPT, 1, SamplingSpec(max_tokens=6, seed=9, stop=()), interrupt=cancelled)
    batch = _batch(llama, kv_need(len(PROMPT), 1, 6))
    results = dict(batch.add([("running", running), ("waiting", waiting)]))
    assert batch.waiting == ["waiting"]
    results.update(batch.step())
    assert isinstance(results["waiting"], OperationCancelledError)
    assert "waiting" not in batch
    while len(batch):
        results.update(batch.step())
    _assert_same(_alone(llama, running), results["running"])


def test_the_engine_samples_within_its_configured_budget(cache_dir: Path) -> None:
    """Engine(sampler_kv_tokens=...) hands its budget to every batch: sixteen requests of
    eight samples, in a budget that holds three at a time, each as it is alone."""
    prompt = [1, 9690, 198, 2683, 359, 253]
    requests = [
        SampleRequest(TINY_DEBUG_NAME, None, prompt, 8, SamplingSpec(max_tokens=5, seed=n))
        for n in range(16)
    ]
    need = kv_need(len(prompt), 8, 5)
    tight = Engine(cache_dir=cache_dir, device="cpu", sampler_kv_tokens=3 * need)
    batch = tight.open_batch(TINY_DEBUG_NAME)
    results = dict(batch.add(list(enumerate(requests))))
    inner = batch._decoding
    assert len(inner.waiting) == 13 and inner.kv.tokens == 3 * need
    while len(batch):
        results.update(batch.step())
    assert inner.kv.peak == 3 * need
    roomy = Engine(cache_dir=cache_dir, device="cpu")
    for n, request in enumerate(requests):
        (alone,) = roomy.sample_batch([request])
        assert isinstance(alone, SampleResult)
        _assert_same(alone, results[n])
