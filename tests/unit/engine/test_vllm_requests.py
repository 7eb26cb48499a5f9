"""The vLLM backend's translation of a sample job into completions requests and back
(`sampling/vllm_requests.py`), on answers shaped as vLLM 0.32's server gives them: Treadle's
stop rules, seeds and scoring positions carried over exactly. (The server itself: the compat
tier's tests/compat/test_vllm_sampling.py.)"""

from __future__ import annotations

import pytest

from treadle.engine.sampling import vllm_requests
from treadle.engine.sampling.prompt_scores import PromptScoring, PromptTargets
from treadle.engine.sampling.rules import SamplingSpec
from treadle.platform.errors import ValidationError


def body(params: SamplingSpec, eos: int | tuple[int, ...] | None = (2, 7)) -> dict:
    return vllm_requests.sample_body(
        "snap-1", [5, 6], 3, params, seed=9, eos_token_id=eos, topk_logprobs=0
    )


def test_without_stop_a_sample_stops_at_the_models_end_of_sequence_ids() -> None:
    b = body(SamplingSpec(max_tokens=4, temperature=0.5, top_p=0.9, seed=None))
    assert b["ignore_eos"] is True and b["stop_token_ids"] == [2, 7] and b["stop"] == []
    assert (b["n"], b["max_tokens"], b["seed"], b["temperature"], b["top_p"]) == (3, 4, 9, 0.5, 0.9)
    assert "top_k" not in b  # -1: off
    assert b["return_token_ids"] and b["prompt"] == [5, 6] and b["model"] == "snap-1"


def test_a_stop_replaces_the_end_of_sequence_ids() -> None:
    assert body(SamplingSpec(stop=(11, 12)))["stop_token_ids"] == [11, 12]
    strings = body(SamplingSpec(stop=("\n\n",), top_k=5))
    assert strings["stop"] == ["\n\n"] and strings["stop_token_ids"] == [] and strings["top_k"] == 5
    never = body(SamplingSpec(stop=()))
    assert never["stop"] == [] and never["stop_token_ids"] == [] and never["ignore_eos"] is True


def test_sequences_keep_the_order_of_their_indices_and_the_top_k() -> None:
    answer = {
        "choices": [
            {
                "index": 1,
                "token_ids": [4],
                "finish_reason": "stop",
                "logprobs": {
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{"token_id:4": -0.5, "token_id:8": -0.25, "token_id:3": -3.0}],
                },
            },
            {
                "index": 0,
                "token_ids": [8, 9],
                "finish_reason": "length",
                "logprobs": {
                    "token_logprobs": [-0.25, -1.0],
                    "top_logprobs": [{"token_id:8": -0.25}, {"token_id:1": -0.1}],
                },
            },
        ]
    }
    first, second = vllm_requests.sequences(answer, topk_logprobs=2)
    assert (first.tokens, first.logprobs, first.stop_reason) == ([8, 9], [-0.25, -1.0], "length")
    assert second.topk_logprobs == [[(8, -0.25), (4, -0.5)]]  # likeliest first, k of them
    assert vllm_requests.sequences(answer, topk_logprobs=0)[0].topk_logprobs is None


def test_a_streamed_answer_is_read_as_it_comes_and_ends_as_the_whole_one() -> None:
    """Chunks as vLLM 0.32 streams a completion of two samples (one choice a chunk, each with
    its step's token ids and logprobs; the finish reason on a choice's last): what each sample
    drew so far after every chunk, and at the end the answer an unstreamed request gets."""
    streamed = vllm_requests.Streamed(2)
    assert streamed.drawn() == ([[], []], [[], []])

    def chunk(i: int, tokens: list[int], logprobs: list[float], reason: str | None) -> dict:
        top = [{f"token_id:{t}": v} for t, v in zip(tokens, logprobs, strict=True)]
        return {
            "choices": [
                {
                    "index": i,
                    "text": "",
                    "token_ids": tokens,
                    "logprobs": {"token_logprobs": logprobs, "top_logprobs": top},
                    "finish_reason": reason,
                }
            ]
        }

    streamed.add(chunk(1, [4], [-0.5], None))
    streamed.add(chunk(0, [8], [-0.25], None))
    assert streamed.drawn() == ([[8], [4]], [[-0.25], [-0.5]])
    streamed.add(chunk(0, [9, 10], [-1.0, -2.0], "length"))
    streamed.add(chunk(1, [5], [-0.75], "stop"))
    assert streamed.drawn() == ([[8, 9, 10], [4, 5]], [[-0.25, -1.0, -2.0], [-0.5, -0.75]])
    first, second = vllm_requests.sequences(streamed.answer(), topk_logprobs=1)
    assert (first.tokens, first.logprobs, first.stop_reason) == (
        [8, 9, 10],
        [-0.25, -1.0, -2.0],
        "length",
    )
    assert (second.tokens, second.stop_reason, second.topk_logprobs) == (
        [4, 5],
        "stop",
        [[(4, -0.5)], [(5, -0.75)]],
    )
    streamed.restart()  # sent again, to a new server
    assert streamed.drawn() == ([[], []], [[], []])
    with pytest.raises(RuntimeError, match="EngineDeadError"):
        streamed.add({"error": {"message": "EngineDeadError", "type": "InternalServerError"}})
    assert vllm_requests.sample_body("m", [1], 1, SamplingSpec(), seed=1, eos_token_id=2,
                                     topk_logprobs=0)["stream"] is True  # fmt: skip


def test_an_aborted_sample_is_an_error_not_a_result() -> None:
    answer = {"choices": [{"index": 0, "token_ids": [], "finish_reason": "abort", "logprobs": {}}]}
    with pytest.raises(RuntimeError, match="abort"):
        vllm_requests.sequences(answer, topk_logprobs=0)


def prompt_answer() -> dict:
    """vLLM's prompt logprobs of the prompt [5, 6, 7]: none at 0, then the token's own entry
    and the top 2 (ranked) after it."""
    rows = [
        None,
        {"6": {"logprob": -1.5, "rank": 3}, "1": {"logprob": -0.1, "rank": 1}, "2": {"logprob": -0.9, "rank": 2}},
        {"7": {"logprob": -0.2, "rank": 1}, "3": {"logprob": -2.0, "rank": 2}},
    ]  # fmt: skip
    return {"choices": [{"index": 0, "prompt_logprobs": rows}]}


def test_prompt_scores_as_the_reference_sampler_reports_them() -> None:
    scores = vllm_requests.prompt_scores(
        prompt_answer(), [5, 6, 7], PromptScoring(logprobs=True, topk=2)
    )
    assert scores.prompt_logprobs == [None, -1.5, -0.2]
    assert scores.topk_prompt_logprobs == [[], [(1, -0.1), (2, -0.9)], [(7, -0.2), (3, -2.0)]]
    tail = vllm_requests.prompt_scores(
        prompt_answer(), [5, 6, 7], PromptScoring(logprobs=True, last_n=1)
    )
    assert tail.prompt_logprobs == [None, None, -0.2] and tail.topk_prompt_logprobs is None


def test_what_vllm_does_not_compute_is_refused_saying_what_to_use() -> None:
    targets = PromptTargets(rows=1, k=1, ids=(3,))
    for scoring in (PromptScoring(targets=targets), PromptScoring(alt_k=2)):
        with pytest.raises(ValidationError, match="reference sampler"):
            vllm_requests.check_supported(scoring)
    vllm_requests.check_supported(PromptScoring(logprobs=True, topk=3))
