"""What a sample request asks about its prompt, computed from one prefill's logits.

Owns `PromptScoring` (the request: prompt logprobs, their top-k, only the last N of them, the
logprobs of chosen token ids, alternative tokens drawn at each position), `PromptTargets` (the
chosen ids, dense or sparse CSR as the client sent them; the platform's rules check them) and
`score_prompt`, which turns the prefill's logits into `PromptScores`. Position i of the prompt
(1 <= i < P) is scored from the logits after prompt[:i]; position 0 has no context. Every logprob
here is under softmax(logits) (temperature 1), as `compute_logprobs` reports; only the
alternative tokens' draws use the request's temperature. Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PromptScores", "PromptScoring", "PromptTargets", "score_prompt"]

_ROWS_PER_PASS = 256  # bounds the float32 [rows, V] temporaries


@dataclass(frozen=True)
class PromptTargets:
    """Token ids to score, an int64 [rows, k] table: cell [r, c] asks for the logprob of
    `ids` at prompt position r + 1; -1 asks for nothing. Dense (`ids` row-major, rows * k of
    them) or sparse CSR (`crow_indices`, `col_indices`; `ids` holds only the listed cells)."""

    rows: int
    k: int
    ids: tuple[int, ...]
    crow_indices: tuple[int, ...] | None = None
    col_indices: tuple[int, ...] | None = None

    def row_of(self) -> np.ndarray:
        """The row of each entry of `ids` (non-decreasing)."""
        if self.crow_indices is None:
            return np.repeat(np.arange(self.rows), self.k)
        return np.repeat(np.arange(self.rows), np.diff(np.asarray(self.crow_indices)))


@dataclass(frozen=True)
class PromptScoring:
    """`logprobs`: each prompt token's logprob; `topk` > 0: the k likeliest tokens at each
    position; `last_n`: only the last N positions get those two (earlier ones None / []);
    `targets`: logprobs of chosen ids; `alt_k` > 0: k tokens drawn at every position."""

    logprobs: bool = False
    topk: int = 0
    last_n: int | None = None
    targets: PromptTargets | None = None
    alt_k: int = 0

    def logits_to_keep(self, prompt_length: int) -> int:
        """How many of the prefill's last positions need logits (0 = all); the last one also
        starts the decoding."""
        if self.targets is not None or self.alt_k:
            return 0
        if self.logprobs or self.topk:
            return 0 if self.last_n is None else min(self.last_n + 1, prompt_length)
        return 1


@dataclass
class PromptScores:
    """`prompt_logprobs[i]` (None where not scored, always at 0); `topk_prompt_logprobs[i]`
    (likeliest first, [] where not scored); `target_logprobs`: one per entry of the targets'
    `ids`, 0.0 where the id is -1; `alt_tokens` / `alt_logprobs`: [P - 1][k]. Each None unless
    asked for."""

    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]]] | None = None
    target_logprobs: list[float] | None = None
    alt_tokens: list[list[int]] | None = None
    alt_logprobs: list[list[float]] | None = None


def score_prompt(
    logits_K_V: torch.Tensor,
    prompt: Sequence[int],
    scoring: PromptScoring,
    *,
    temperature: float,
    generator: torch.Generator,
) -> PromptScores:
    """Scores from the prefill's float32 logits of the prompt's last K positions (K as
    `scoring.logits_to_keep` asked, all P when 0)."""
    length = len(prompt)
    first = length - logits_K_V.shape[0]  # the prompt position of logits_K_V[0]
    scores = PromptScores()
    scored = length - (scoring.last_n or length - 1)  # the first prompt position scored
    if scoring.logprobs or scoring.topk:
        # the logits after prompt[:i] predict position i: rows i - 1 - first, i in [scored, P)
        assert scored - 1 - first >= 0, "the prefill kept too few positions' logits"
        rows_S_V = logits_K_V[scored - 1 - first : length - 1 - first]
    if scoring.logprobs:
        targets_S = torch.tensor(list(prompt[scored:]), device=logits_K_V.device)
        picked_S = rows_S_V.gather(-1, targets_S[:, None])[:, 0]
        lp_S = (picked_S - torch.logsumexp(rows_S_V, dim=-1)).tolist()
        scores.prompt_logprobs = [None] * scored + lp_S
    if scoring.topk:
        empty: list[list[tuple[int, float]]] = [[] for _ in range(scored)]
        scores.topk_prompt_logprobs = empty + topk_logprobs(rows_S_V, scoring.topk)
    if scoring.targets is not None:
        assert first == 0, "target logprobs need every position's logits"
        scores.target_logprobs = _target_logprobs(logits_K_V[:-1], scoring.targets)
    if scoring.alt_k:
        assert first == 0, "alternative tokens need every position's logits"
        tokens, logprobs = _alt_tokens(logits_K_V[:-1], scoring.alt_k, temperature, generator)
        scores.alt_tokens, scores.alt_logprobs = tokens, logprobs
    return scores


def topk_logprobs(logits_T_V: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Per position, the `k` likeliest (token id, logprob) under softmax(logits), likeliest
    first."""
    rows: list[list[tuple[int, float]]] = []
    for start in range(0, logits_T_V.shape[0], _ROWS_PER_PASS):
        logprobs_R_V = torch.log_softmax(logits_T_V[start : start + _ROWS_PER_PASS], dim=-1)
        values_R_K, ids_R_K = torch.topk(logprobs_R_V, k, dim=-1)  # sorted, descending
        for ids, values in zip(ids_R_K.tolist(), values_R_K.tolist(), strict=True):
            rows.append(list(zip(ids, values, strict=True)))
    return rows


def _target_logprobs(logits_R_V: torch.Tensor, targets: PromptTargets) -> list[float]:
    """log softmax(logits_R_V[row])[id] for each entry of `targets.ids`, 0.0 where it is -1."""
    row_E = targets.row_of()
    ids_E = np.asarray(targets.ids, np.int64)
    out_E = np.zeros(ids_E.size, np.float32)
    for start in range(0, logits_R_V.shape[0], _ROWS_PER_PASS):
        lo, hi = np.searchsorted(row_E, [start, start + _ROWS_PER_PASS])
        wanted = np.flatnonzero(ids_E[lo:hi] >= 0) + lo
        if not wanted.size:
            continue
        logprobs_R_V = torch.log_softmax(logits_R_V[start : start + _ROWS_PER_PASS], dim=-1)
        rows = torch.from_numpy(row_E[wanted] - start).to(logits_R_V.device)
        ids = torch.from_numpy(ids_E[wanted]).to(logits_R_V.device)
        out_E[wanted] = logprobs_R_V[rows, ids].cpu().numpy()
    return out_E.tolist()


def _alt_tokens(
    logits_R_V: torch.Tensor, k: int, temperature: float, generator: torch.Generator
) -> tuple[list[list[int]], list[list[float]]]:
    """Per row, k independent draws (with replacement) from softmax(logits / temperature), the
    likeliest token k times when greedy, and each draw's logprob under softmax(logits)."""
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    for start in range(0, logits_R_V.shape[0], _ROWS_PER_PASS):
        chunk_R_V = logits_R_V[start : start + _ROWS_PER_PASS]
        if temperature == 0.0:
            drawn_R_K = chunk_R_V.argmax(dim=-1, keepdim=True).expand(-1, k)
        else:
            probs_R_V = torch.softmax(chunk_R_V / temperature, dim=-1)
            drawn_R_K = torch.multinomial(probs_R_V, k, replacement=True, generator=generator)
        logprobs_R_K = torch.log_softmax(chunk_R_V, dim=-1).gather(-1, drawn_R_K)
        tokens.extend(drawn_R_K.tolist())
        logprobs.extend(logprobs_R_K.tolist())
    return tokens, logprobs
