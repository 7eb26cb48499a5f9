"""Batched sampling of continuations of one prompt, with a KV cache.

Owns `SamplingSpec`, the sample results and the decode loop: prefill the prompt once (scoring it
as `prompt_scores` is asked), repeat its KV cache for `num_samples` rows, then decode step by step
with temperature, top-k, top-p, a per-call seeded generator and stop tokens/strings, recording
each token's logprob and, if asked, the top-k at each step. Knows nothing of adapters: the caller
activates the weights to sample with. Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import inspect
import operator
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from treadle.gpu_worker.prompt_scores import (
    PromptScoring,
    PromptTargets,
    score_prompt,
    topk_logprobs,
    validate_scoring,
)
from treadle.platform.errors import ValidationError
from treadle.platform.validation import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P

__all__ = [
    "PromptScoring",
    "PromptTargets",
    "SampleResult",
    "SampledSequence",
    "SamplingSpec",
    "generate",
    "validate_sampling",
]
# The alternative-token draws use their own generator, so asking for them leaves the sampled
# continuations of a seeded request unchanged.
_ALT_SEED_OFFSET = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class SamplingSpec:
    """`temperature` 0 = greedy; `top_k` -1 (or 0) = off; `stop` None = stop at EOS, ints = stop
    token ids (kept in the output), strings = stop once the decoded continuation contains one,
    () = never stop early (a bare string is read as a one-string tuple); `seed` None = a fresh
    random seed."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: tuple[str, ...] | tuple[int, ...] | str | None = None
    seed: int | None = None


@dataclass
class SampledSequence:
    """`logprobs[j]` and `topk_logprobs[j]` (the k likeliest (token id, logprob), likeliest
    first; None unless asked for) are under the distribution token j was drawn from before
    top-k/top-p truncation: softmax(logits / temperature), softmax(logits) when greedy."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    topk_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class SampleResult:
    """`prompt_logprobs[i]`: logprob of prompt token i given its prefix (None at 0 and before
    the last N when only those were asked for); `topk_prompt_logprobs[i]`: the k likeliest
    (token id, logprob) after prompt[:i], likeliest first ([] where not scored);
    `target_prompt_logprobs`: one logprob per id of the request's `PromptTargets` (0.0 for -1);
    `prompt_alt_tokens` / `prompt_alt_logprobs`: [P - 1][k] draws and their logprobs. Prompt
    logprobs are at temperature 1; each field is None unless asked for."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None
    prefill_tokens: int
    sample_tokens: int
    topk_prompt_logprobs: list[list[tuple[int, float]]] | None = None
    target_prompt_logprobs: list[float] | None = None
    prompt_alt_tokens: list[list[int]] | None = None
    prompt_alt_logprobs: list[list[float]] | None = None


def validate_sampling(
    prompt: Sequence[int],
    num_samples: int,
    params: SamplingSpec,
    *,
    vocab_size: int,
    max_context_length: int,
    scoring: PromptScoring | None = None,
    topk_sample_logprobs: int = 0,
) -> list[int]:
    """`prompt` as a list of ints; ValidationError saying what is wrong with the request, and
    how to fix it, otherwise."""
    if len(prompt) == 0:
        raise ValidationError("prompt is empty; send at least one token")
    tokens: list[int] = []
    for j, token in enumerate(prompt):
        try:
            tokens.append(operator.index(token))
        except TypeError:
            raise ValidationError(f"prompt[{j}] = {token!r} is not an integer token id") from None
        if not 0 <= tokens[-1] < vocab_size:
            raise ValidationError(
                f"prompt[{j}] = {tokens[-1]} is not a token id of this model; ids must be in "
                f"[0, {vocab_size})"
            )
    if num_samples < 1:
        raise ValidationError(f"num_samples is {num_samples}; it must be at least 1")
    validate_scoring(scoring or PromptScoring(), len(tokens), vocab_size)
    if not 0 <= topk_sample_logprobs <= vocab_size:
        raise ValidationError(
            f"topk_sample_logprobs is {topk_sample_logprobs}; it must be between 0 (off) and "
            f"the vocabulary size {vocab_size}"
        )
    if params.max_tokens < 0:
        raise ValidationError(f"max_tokens is {params.max_tokens}; it must be 0 or more")
    if len(prompt) + params.max_tokens > max_context_length:
        raise ValidationError(
            f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
            f"model's maximum context of {max_context_length}; shorten one of them"
        )
    # The API refuses these first (the same limits, treadle/platform/validation.py); the engine
    # checks again because what it is given must never become a server error.
    if not (params.temperature == 0.0 or MIN_TEMPERATURE <= params.temperature <= MAX_TEMPERATURE):
        raise ValidationError(
            f"temperature is {params.temperature}; use 0 (greedy) or a value in "
            f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]"
        )
    if params.top_k < -1:
        raise ValidationError(f"top_k is {params.top_k}; use -1 for no limit or a positive k")
    if not MIN_TOP_P <= params.top_p <= 1.0:
        raise ValidationError(f"top_p is {params.top_p}; it must be in [{MIN_TOP_P}, 1]")
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise ValidationError(f"seed is {params.seed}; it must be in [0, 2**64 - 1]")
    stop = _stop_tuple(params.stop) or ()
    if not (all(isinstance(s, str) for s in stop) or all(isinstance(s, int) for s in stop)):
        raise ValidationError("stop must be all strings or all token ids, not a mix")
    if any(isinstance(s, str) and not s for s in stop):
        raise ValidationError("stop holds an empty string; remove it")
    return tokens


def generate(
    model: PreTrainedModel,
    prompt: Sequence[int],
    num_samples: int,
    params: SamplingSpec,
    *,
    eos_token_id: int | None,
    decode: Callable[[list[int]], str],
    scoring: PromptScoring | None = None,
    topk_sample_logprobs: int = 0,
    interrupt: Callable[[], None] | None = None,
) -> SampleResult:
    """Sample `num_samples` continuations of `prompt` with whatever weights `model` runs now,
    scoring the prompt as `scoring` asks (see `prompt_scores`) and, with `topk_sample_logprobs`
    = k > 0, the k likeliest tokens at each sampled position. `interrupt` is called before each
    decoding step; what it raises ends the call.

    Per-token logprobs are under softmax(logits / temperature) before top-k/top-p truncation
    (under softmax(logits) when greedy); prompt logprobs under softmax(logits). Call
    `validate_sampling` first.
    """
    scoring = scoring or PromptScoring()
    device = next(model.parameters()).device
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    generator = torch.Generator(device=device).manual_seed(seed)
    stop_ids, stop_strings = _stop_rules(params.stop, eos_token_id)
    tokens_N: list[list[int]] = [[] for _ in range(num_samples)]
    logprobs_N: list[list[float]] = [[] for _ in range(num_samples)]
    topk_N: list[list[list[tuple[int, float]]]] = [[] for _ in range(num_samples)]
    reasons: list[str | None] = [None] * num_samples

    with torch.inference_mode():
        prompt_1_P = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        cache = DynamicCache(config=model.config)
        kwarg = _cache_kwarg(model)
        keep = scoring.logits_to_keep(len(prompt))
        out = model(input_ids=prompt_1_P, use_cache=True, logits_to_keep=keep, **{kwarg: cache})
        logits_1_K_V = out.logits.float()
        scores = score_prompt(
            logits_1_K_V[0],
            prompt,
            scoring,
            temperature=params.temperature,
            generator=torch.Generator(device=device).manual_seed((seed + _ALT_SEED_OFFSET) % 2**64),
        )
        if params.max_tokens > 0:
            cache.batch_repeat_interleave(num_samples)
            logits_N_V = logits_1_K_V[:, -1].expand(num_samples, -1)
        for step in range(params.max_tokens):
            if interrupt is not None:
                interrupt()
            chosen_N, lp_N = _choose(logits_N_V, params, generator)
            topk_rows = (
                topk_logprobs(_sampling_logits(logits_N_V, params), topk_sample_logprobs)
                if topk_sample_logprobs
                else None
            )
            for row, (token, lp) in enumerate(zip(chosen_N.tolist(), lp_N.tolist(), strict=True)):
                if reasons[row] is not None:
                    continue
                tokens_N[row].append(token)
                logprobs_N[row].append(lp)
                if topk_rows is not None:
                    topk_N[row].append(topk_rows[row])
                if token in stop_ids or (
                    stop_strings and any(s in decode(tokens_N[row]) for s in stop_strings)
                ):
                    reasons[row] = "stop"
            if all(r is not None for r in reasons) or step == params.max_tokens - 1:
                break
            out = model(input_ids=chosen_N[:, None], use_cache=True, **{kwarg: cache})
            logits_N_V = out.logits[:, -1].float()

    sequences = [
        SampledSequence(
            tokens=t,
            logprobs=lp,
            stop_reason=r or "length",
            topk_logprobs=topk if topk_sample_logprobs else None,
        )
        for t, lp, r, topk in zip(tokens_N, logprobs_N, reasons, topk_N, strict=True)
    ]
    return SampleResult(
        sequences=sequences,
        prompt_logprobs=scores.prompt_logprobs,
        prefill_tokens=len(prompt),
        sample_tokens=sum(len(t) for t in tokens_N),
        topk_prompt_logprobs=scores.topk_prompt_logprobs,
        target_prompt_logprobs=scores.target_logprobs,
        prompt_alt_tokens=scores.alt_tokens,
        prompt_alt_logprobs=scores.alt_logprobs,
    )


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers 5 renamed `past_key_values` to `cache` (the old name warns, then goes)."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _stop_tuple(
    stop: tuple[str, ...] | tuple[int, ...] | str | None,
) -> tuple[str, ...] | tuple[int, ...] | None:
    return (stop,) if isinstance(stop, str) else stop


def _stop_rules(
    stop: tuple[str, ...] | tuple[int, ...] | str | None, eos_token_id: int | None
) -> tuple[set[int], tuple[str, ...]]:
    stop = _stop_tuple(stop)
    if stop is None:
        return ({eos_token_id} if eos_token_id is not None else set()), ()
    return {s for s in stop if isinstance(s, int)}, tuple(s for s in stop if isinstance(s, str))


def _token_logprobs(logits_B_T_V: torch.Tensor, tokens_B_T: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per position, computed without materialising the softmax."""
    picked_B_T = logits_B_T_V.gather(-1, tokens_B_T[..., None])[..., 0]
    return picked_B_T - torch.logsumexp(logits_B_T_V, dim=-1)


def _sampling_logits(logits_N_V: torch.Tensor, params: SamplingSpec) -> torch.Tensor:
    """The logits whose softmax a token is drawn from before truncation (and its logprob is
    reported under): logits / temperature, the logits themselves when greedy."""
    return logits_N_V if params.temperature == 0.0 else logits_N_V / params.temperature


def _choose(
    logits_N_V: torch.Tensor, params: SamplingSpec, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its logprob (before truncation)."""
    if params.temperature == 0.0:
        chosen_N = logits_N_V.argmax(dim=-1)
        return chosen_N, _token_logprobs(logits_N_V, chosen_N)
    logprobs_N_V = torch.log_softmax(_sampling_logits(logits_N_V, params), dim=-1)
    truncated_N_V = logprobs_N_V
    vocab = logprobs_N_V.shape[-1]
    if 0 < params.top_k < vocab:
        kth_N_1 = torch.topk(truncated_N_V, params.top_k, dim=-1).values[:, -1:]
        truncated_N_V = truncated_N_V.masked_fill(truncated_N_V < kth_N_1, float("-inf"))
    if params.top_p < 1.0:
        sorted_N_V, order_N_V = torch.sort(truncated_N_V, dim=-1, descending=True)
        probs_N_V = torch.softmax(sorted_N_V, dim=-1)
        mass_before_N_V = probs_N_V.cumsum(dim=-1) - probs_N_V
        drop_sorted_N_V = mass_before_N_V >= params.top_p  # the top token is always kept
        drop_N_V = torch.zeros_like(drop_sorted_N_V).scatter(-1, order_N_V, drop_sorted_N_V)
        truncated_N_V = truncated_N_V.masked_fill(drop_N_V, float("-inf"))
    probs_N_V = torch.softmax(truncated_N_V, dim=-1)
    chosen_N = torch.multinomial(probs_N_V, 1, generator=generator)[:, 0]
    return chosen_N, logprobs_N_V.gather(-1, chosen_N[:, None])[:, 0]
