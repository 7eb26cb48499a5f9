"""What a sample request is and how one decoding step chooses its tokens.

Owns `SamplingSpec`, the sample results, the check of a request (the platform's rules, the ones
admission runs) and the per-step rules: temperature, top-k, top-p, a seeded draw per request
(`choose`), stop tokens/strings (`stop_rules`). The decode loop that runs many requests together
with a KV cache is `decode`'s. Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from treadle.engine.sampling.prompt_scores import PromptScoring, PromptTargets
from treadle.platform.models import validation

__all__ = [
    "PromptScoring",
    "PromptTargets",
    "SampleResult",
    "SampledSequence",
    "SamplingSpec",
    "choose",
    "stop_rules",
    "validate_sampling",
]
# The alternative-token draws use their own generator, so asking for them leaves the sampled
# continuations of a seeded request unchanged.
ALT_SEED_OFFSET = 0x9E3779B97F4A7C15


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
    model_name: str = "the model",
    scoring: PromptScoring | None = None,
    topk_sample_logprobs: int = 0,
) -> list[int]:
    """`prompt` as a list of ints, once the platform's rules (the ones admission runs) pass;
    ValidationError saying what is wrong with the request, and how to fix it, otherwise."""
    limits = validation.Limits(model_name, vocab_size, max_context_length)
    tokens = np.asarray(prompt)
    validation.check_prompt(tokens, params.max_tokens, limits)
    validation.check_sampling(
        num_samples,
        params.temperature,
        params.top_k,
        params.top_p,
        params.seed,
        _stop_tuple(params.stop) or (),
    )
    scoring = scoring or PromptScoring()
    validation.check_prompt_scoring(
        tokens.size,
        limits,
        logprobs=scoring.logprobs,
        topk=scoring.topk,
        last_n=scoring.last_n,
        alt_k=scoring.alt_k,
        topk_sample=topk_sample_logprobs,
    )
    if (t := scoring.targets) is not None:
        validation.check_prompt_targets(
            tokens.size, (t.rows, t.k), t.ids, t.crow_indices, t.col_indices, limits
        )
    return [int(token) for token in tokens]


def cache_kwarg(model: PreTrainedModel) -> str:
    """transformers 5 renamed `past_key_values` to `cache` (the old name warns, then goes)."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


EosIds = int | tuple[int, ...] | None  # a model's end-of-sequence id, or ids


def _stop_tuple(
    stop: tuple[str, ...] | tuple[int, ...] | str | None,
) -> tuple[str, ...] | tuple[int, ...] | None:
    return (stop,) if isinstance(stop, str) else stop


def stop_rules(
    stop: tuple[str, ...] | tuple[int, ...] | str | None, eos_token_id: EosIds
) -> tuple[set[int], tuple[str, ...]]:
    """The token ids and strings a sample stops at: `stop`'s, or else the end-of-sequence
    id(s)."""
    stop = _stop_tuple(stop)
    if stop is None:
        if eos_token_id is None:
            return set(), ()
        return ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)), ()
    return {s for s in stop if isinstance(s, int)}, tuple(s for s in stop if isinstance(s, str))


def _token_logprobs(logits_B_T_V: torch.Tensor, tokens_B_T: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per position, computed without materialising the softmax."""
    picked_B_T = logits_B_T_V.gather(-1, tokens_B_T[..., None])[..., 0]
    return picked_B_T - torch.logsumexp(logits_B_T_V, dim=-1)


def sampling_logits(logits_N_V: torch.Tensor, params: SamplingSpec) -> torch.Tensor:
    """The logits whose softmax a token is drawn from before truncation (and its logprob is
    reported under): logits / temperature, the logits themselves when greedy."""
    return logits_N_V if params.temperature == 0.0 else logits_N_V / params.temperature


def choose(
    logits_N_V: torch.Tensor, params: SamplingSpec, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its logprob (before truncation)."""
    if params.temperature == 0.0:
        chosen_N = logits_N_V.argmax(dim=-1)
        return chosen_N, _token_logprobs(logits_N_V, chosen_N)
    logprobs_N_V = torch.log_softmax(sampling_logits(logits_N_V, params), dim=-1)
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
