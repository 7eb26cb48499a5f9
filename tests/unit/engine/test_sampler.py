"""Sampling through the engine on the tiny debug model (CPU): determinism, seeds, stopping,
truncation, and every logprob it reports against a forward pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import (
    PROMPT,
    TINY,
    bare_model,
    ce_datum,
    logprobs,
    new_adapter,
    train,
)

from treadle.engine import Engine, SamplingSpec
from treadle.platform.errors import ValidationError

GREEDY = SamplingSpec(max_tokens=6, temperature=0.0, stop=())


def test_greedy_sampling_is_deterministic(engine: Engine) -> None:
    first = engine.sample(TINY, None, PROMPT, 3, GREEDY)
    again = engine.sample(TINY, None, PROMPT, 1, GREEDY)
    assert len({tuple(s.tokens) for s in first.sequences}) == 1
    assert first.sequences[0].tokens == again.sequences[0].tokens
    assert first.prefill_tokens == len(PROMPT) and first.sample_tokens == 18


@pytest.mark.parametrize(
    "truncation", [{}, {"top_k": 50, "top_p": 0.9}], ids=["plain", "top-k-top-p"]
)
def test_fixed_seed_reproduces_and_seeds_differ(
    engine: Engine, truncation: dict[str, float]
) -> None:
    def run(seed: int) -> list[list[int]]:
        params = SamplingSpec(max_tokens=5, temperature=1.0, seed=seed, stop=(), **truncation)  # type: ignore[arg-type]
        return [s.tokens for s in engine.sample(TINY, None, PROMPT, 3, params).sequences]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert len({tuple(t) for t in run(7)}) > 1  # the rows of one call differ too


def test_top_k_1_equals_greedy(engine: Engine) -> None:
    greedy = engine.sample(TINY, None, PROMPT, 1, GREEDY).sequences[0]
    for seed in (1, 2):
        params = SamplingSpec(max_tokens=6, temperature=1.0, top_k=1, seed=seed, stop=())
        seq = engine.sample(TINY, None, PROMPT, 2, params).sequences[1]
        assert seq.tokens == greedy.tokens
        # logprobs are before truncation, at temperature 1: the same as greedy's
        np.testing.assert_allclose(seq.logprobs, greedy.logprobs, atol=1e-6)


def test_max_tokens_and_stop_tokens_end_sequences(engine: Engine) -> None:
    free = engine.sample(TINY, None, PROMPT, 1, SamplingSpec(max_tokens=5, temperature=0, stop=()))
    tokens = free.sequences[0].tokens
    assert len(tokens) == 5 and free.sequences[0].stop_reason == "length"
    stop_token = tokens[2]
    stopped = engine.sample(
        TINY, None, PROMPT, 1, SamplingSpec(max_tokens=5, temperature=0.0, stop=(stop_token,))
    ).sequences[0]
    assert stopped.tokens == tokens[: tokens.index(stop_token) + 1]  # the stop token is kept
    assert stopped.stop_reason == "stop"


def test_stop_string_ends_sequence(engine: Engine) -> None:
    tok = engine.tokenizer(TINY)
    text = tok.decode(engine.sample(TINY, None, PROMPT, 1, GREEDY).sequences[0].tokens)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    for spec_stop in ((stop,), stop):  # a bare string means one stop string
        params = SamplingSpec(max_tokens=6, temperature=0.0, stop=spec_stop)
        seq = engine.sample(TINY, None, PROMPT, 1, params).sequences[0]
        assert seq.stop_reason == "stop" and stop in tok.decode(seq.tokens)
        assert stop not in tok.decode(seq.tokens[:-1])


def test_sample_and_prompt_logprobs_equal_forward_logprobs(engine: Engine) -> None:
    adapter = new_adapter(engine)
    train(engine, adapter, 2)
    engine.snapshot(adapter, "lp-snap")
    params = SamplingSpec(max_tokens=6, temperature=1.0, seed=5, stop=())
    result = engine.sample(TINY, "lp-snap", PROMPT, 2, params, prompt_logprobs=True)
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    assert result.topk_prompt_logprobs is None  # not asked for
    for seq in result.sequences:
        lp = logprobs(engine, adapter, [ce_datum(PROMPT + seq.tokens)])[0]
        np.testing.assert_allclose(seq.logprobs, lp[len(PROMPT) - 1 :], atol=1e-4)
        np.testing.assert_allclose(result.prompt_logprobs[1:], lp[: len(PROMPT) - 1], atol=1e-4)


def test_topk_prompt_logprobs_are_the_likeliest_tokens(engine: Engine, cache_dir: Path) -> None:
    k = 5
    result = engine.sample(
        TINY, None, PROMPT, 1, SamplingSpec(max_tokens=0), topk_prompt_logprobs=k
    )
    topk = result.topk_prompt_logprobs
    assert topk is not None and len(topk) == len(PROMPT) and topk[0] == []
    assert result.prompt_logprobs is None  # only what was asked for
    with torch.no_grad():  # the full distribution, from the bare model in plain PyTorch
        logits_P_V = bare_model(cache_dir)(torch.tensor([PROMPT])).logits[0]
    expected_values, expected_ids = torch.log_softmax(logits_P_V, -1)[:-1].topk(k, dim=-1)
    for position, pairs in enumerate(topk[1:]):
        ids, values = [i for i, _ in pairs], [v for _, v in pairs]
        assert values == sorted(values, reverse=True)
        assert ids == expected_ids[position].tolist()
        np.testing.assert_allclose(values, expected_values[position], atol=1e-5)


def test_topk_prompt_logprobs_agree_with_prompt_logprobs(engine: Engine) -> None:
    """Each prompt token is in its position's top-k with its own logprob, or less likely than
    all of them."""
    adapter = new_adapter(engine)  # trained on the prompt, so its tokens become likely
    train(engine, adapter, 5, [ce_datum(PROMPT)])
    engine.snapshot(adapter, "topk-snap")
    params = SamplingSpec(max_tokens=0)
    result = engine.sample(
        TINY, "topk-snap", PROMPT, 1, params, prompt_logprobs=True, topk_prompt_logprobs=3
    )
    assert result.topk_prompt_logprobs is not None and result.prompt_logprobs is not None
    found = 0
    for token, lp, pairs in zip(
        PROMPT[1:], result.prompt_logprobs[1:], result.topk_prompt_logprobs[1:], strict=True
    ):
        assert len(pairs) == 3
        if token in dict(pairs):
            assert dict(pairs)[token] == pytest.approx(lp, abs=1e-5)
            found += 1
        else:
            assert lp is not None and lp <= pairs[-1][1]
    assert found >= 3


def test_snapshot_keeps_weights_from_snapshot_time(engine: Engine) -> None:
    adapter = new_adapter(engine)
    train(engine, adapter, 1)
    engine.snapshot(adapter, "frozen-snap")
    params = SamplingSpec(max_tokens=0)
    before = engine.sample(TINY, "frozen-snap", PROMPT, 1, params, prompt_logprobs=True)
    train(engine, adapter, 2)
    after = engine.sample(TINY, "frozen-snap", PROMPT, 1, params, prompt_logprobs=True)
    assert before.prompt_logprobs == after.prompt_logprobs
    assert before.prompt_logprobs is not None
    lp_now = logprobs(engine, adapter, [ce_datum(PROMPT)])[0]
    assert not np.allclose(lp_now, np.asarray(before.prompt_logprobs[1:], np.float32))


@pytest.mark.parametrize(
    ("params", "kwargs", "match"),
    [
        (SamplingSpec(top_p=0.0), {}, "top_p"),
        (SamplingSpec(max_tokens=2048), {}, "maximum context"),
        (SamplingSpec(), {"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
        (SamplingSpec(stop=("a", 3)), {}, "mix"),  # type: ignore[arg-type]
    ],
)
def test_bad_sampling_requests_are_rejected(
    engine: Engine, params: SamplingSpec, kwargs: dict[str, int], match: str
) -> None:
    with pytest.raises(ValidationError, match=match):
        engine.sample(TINY, None, PROMPT, 1, params, **kwargs)  # type: ignore[arg-type]


def test_empty_prompt_is_rejected(engine: Engine) -> None:
    with pytest.raises(ValidationError, match="prompt"):
        engine.sample(TINY, None, [], 1, SamplingSpec())
