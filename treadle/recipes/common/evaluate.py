"""Sampling many prompts at once and scoring them. Every request is sent before any is waited
for, so the worker decodes them in one batch; each carries its own seed, so results do not depend
on how the platform batches them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tinker import types

from treadle.recipes.common.chat import completion_text


def sample_all(
    sampler: Any,
    prompts: Sequence[Sequence[int]],
    *,
    num_samples: int,
    max_tokens: int,
    temperature: float,
    seeds: Sequence[int],
    stop: list[str] | list[int] | None = None,
) -> list[Any]:
    """One SampleResponse per prompt (`num_samples` sequences each), in prompt order."""
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(list(prompt)),
            num_samples,
            types.SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop
            ),
        )
        for prompt, seed in zip(prompts, seeds, strict=True)
    ]
    return [f.result() for f in futures]


def greedy_score(
    sampler: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    score: Callable[[int, str], float],
    *,
    max_tokens: int,
) -> tuple[float, list[str]]:
    """Mean of `score(i, text)` over greedy replies to the prompts, and the replies."""
    responses = sample_all(
        sampler, prompts, num_samples=1, max_tokens=max_tokens, temperature=0.0,
        seeds=[0] * len(prompts),
    )  # fmt: skip
    texts = [completion_text(tokenizer, r.sequences[0].tokens) for r in responses]
    return sum(score(i, t) for i, t in enumerate(texts)) / len(texts), texts
