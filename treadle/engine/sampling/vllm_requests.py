"""A sample job as vLLM's completions requests, and their answers as a `SampleResult`.

Owns the translation both ways, with no I/O: `sample_body` (the samples: token ids in and out,
per-request seed, temperature, top-k/top-p, stop ids and strings, top-k logprobs per position)
and `scoring_body` (the prompt's logprobs and their top-k, a request of its own: vLLM fails a
request that asks for prompt logprobs of several samples with a LoRA on the output head), then
`sequences` and `prompt_scores` read the answers. Samples are streamed (`Streamed` gathers
the chunks: what each sample has drawn so far, and at the end the answer an unstreamed request
gets). Stop rules are Treadle's: no `stop` stops at the model's end-of-sequence ids; any `stop`
replaces them (`rules.stop_rules`); a stop token stays in the output. Must not import flask,
sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from treadle.engine.sampling.prompt_scores import PromptScores, PromptScoring
from treadle.engine.sampling.rules import EosIds, SampledSequence, SamplingSpec, stop_rules
from treadle.platform.errors import ValidationError

__all__ = [
    "Streamed",
    "check_supported",
    "prompt_scores",
    "sample_body",
    "scoring_body",
    "sequences",
]


def check_supported(scoring: PromptScoring) -> None:
    """ValidationError for what vLLM does not compute: logprobs of chosen prompt ids and
    alternative tokens drawn at every prompt position."""
    if scoring.targets is not None or scoring.alt_k:
        what = "target prompt logprobs" if scoring.targets is not None else "alternative tokens"
        raise ValidationError(
            f"this worker samples with vLLM, which does not compute {what}; ask for prompt "
            "logprobs and their top-k instead, or use a worker with the reference sampler "
            "(TREADLE_SAMPLER_BACKEND=reference)"
        )


def sample_body(
    model: str,
    prompt: list[int],
    num_samples: int,
    params: SamplingSpec,
    *,
    seed: int,
    eos_token_id: EosIds,
    topk_logprobs: int,
) -> dict[str, Any]:
    """The completions request for `num_samples` continuations of `prompt` (max_tokens > 0)."""
    stop_ids, stop_strings = stop_rules(params.stop, eos_token_id)
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "n": num_samples,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": seed,
        "logprobs": topk_logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        # the stop rules are all here: the model's own end-of-sequence ids only when no stop
        # was given (then they are `stop_ids`)
        "ignore_eos": True,
        "stop_token_ids": sorted(stop_ids),
        "stop": list(stop_strings),
        # each step's tokens as they are drawn (`Streamed`), for the clients that stream them
        "stream": True,
    }
    if params.top_k > 0:
        body["top_k"] = params.top_k
    return body


class Streamed:
    """The chunks of a streamed `sample_body` request of `n` samples, gathered as they come (by
    the thread that reads the stream) and read meanwhile (`drawn`, by the batch's thread)."""

    def __init__(self, n: int) -> None:
        self._lock = threading.Lock()
        self._n = n
        self._choices: list[dict[str, Any]] = []
        self.restart()

    def restart(self) -> None:
        """Forget what came: the request is sent again (to a new server)."""
        with self._lock:
            self._choices = [
                {
                    "index": i,
                    "token_ids": [],
                    "logprobs": {"token_logprobs": [], "top_logprobs": []},
                    "finish_reason": None,
                }
                for i in range(self._n)
            ]

    def add(self, chunk: dict[str, Any]) -> None:
        """One chunk: each choice's new tokens and logprobs, and its finish reason at the end.
        An error chunk (vLLM's engine failed under the stream) raises RuntimeError."""
        if "error" in chunk:
            raise RuntimeError(f"vLLM failed the stream: {chunk['error']}")
        with self._lock:
            for delta in chunk.get("choices") or []:
                choice = self._choices[int(delta["index"])]
                choice["token_ids"] += [int(t) for t in delta.get("token_ids") or []]
                logprobs = delta.get("logprobs") or {}
                choice["logprobs"]["token_logprobs"] += logprobs.get("token_logprobs") or []
                choice["logprobs"]["top_logprobs"] += logprobs.get("top_logprobs") or []
                if delta.get("finish_reason") is not None:
                    choice["finish_reason"] = delta["finish_reason"]

    def drawn(self) -> tuple[list[list[int]], list[list[float]]]:
        """Each sample's tokens so far and their logprobs."""
        with self._lock:
            tokens, logprobs = [], []
            for choice in self._choices:
                values = choice["logprobs"]["token_logprobs"]
                n = min(len(choice["token_ids"]), len(values))
                tokens.append(list(choice["token_ids"][:n]))
                logprobs.append([float(v) for v in values[:n]])
            return tokens, logprobs

    def answer(self) -> dict[str, Any]:
        """The whole answer, as an unstreamed request's (`sequences` reads it)."""
        with self._lock:
            return {"choices": copy.deepcopy(self._choices)}


def scoring_body(model: str, prompt: list[int], scoring: PromptScoring) -> dict[str, Any]:
    """One greedy token after `prompt` (discarded), for the prompt's logprobs and top-k."""
    return {
        "model": model,
        "prompt": prompt,
        "n": 1,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": scoring.topk,
        "return_token_ids": True,
    }


def sequences(answer: dict[str, Any], topk_logprobs: int) -> list[SampledSequence]:
    """Each sample of a completions answer (`sample_body`'s), in order."""
    out: list[SampledSequence] = []
    for choice in sorted(answer["choices"], key=lambda c: int(c["index"])):
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a sample with finish_reason {reason!r}")
        tokens = [int(t) for t in choice["token_ids"]]
        logprobs = choice["logprobs"] or {}
        values = [float(v) for v in logprobs.get("token_logprobs") or []]
        if len(values) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(values)} logprobs for {len(tokens)} tokens")
        topk = None
        if topk_logprobs:
            topk = [_top(row, topk_logprobs) for row in logprobs["top_logprobs"]]
        out.append(SampledSequence(tokens, values, reason, topk))
    return out


def prompt_scores(
    answer: dict[str, Any], prompt: list[int], scoring: PromptScoring
) -> PromptScores:
    """The prompt's logprobs and top-k from a `scoring_body` answer, as the reference sampler
    reports them (`prompt_scores.score_prompt`): None / [] at position 0 and before the last N."""
    rows = answer["choices"][0]["prompt_logprobs"]
    length = len(prompt)
    if len(rows) != length:
        raise RuntimeError(f"vLLM scored {len(rows)} positions of a {length}-token prompt")
    scored = length - (scoring.last_n or length - 1)  # the first position scored
    scores = PromptScores()
    if scoring.logprobs:
        scores.prompt_logprobs = [None] * scored + [
            float(rows[i][str(prompt[i])]["logprob"]) for i in range(scored, length)
        ]
    if scoring.topk:
        ranked = [
            sorted(
                (
                    (int(t), float(e["logprob"]))
                    for t, e in rows[i].items()
                    if e["rank"] <= scoring.topk
                ),
                key=lambda pair: -pair[1],
            )[: scoring.topk]
            for i in range(scored, length)
        ]
        scores.topk_prompt_logprobs = [[] for _ in range(scored)] + ranked
    return scores


def _top(row: dict[str, float], k: int) -> list[tuple[int, float]]:
    """A position's `k` likeliest (token id, logprob), likeliest first, from vLLM's
    {"token_id:ID": logprob} (which may add the drawn token as k + 1st)."""
    pairs = [(int(key.rsplit(":", 1)[1]), float(value)) for key, value in row.items()]
    return sorted(pairs, key=lambda pair: -pair[1])[:k]
