"""The sampling options the tinker SDK can send besides the sampling parameters, through the engine
on the tiny model (CPU), each against an independent computation: a plain forward pass of the
bare base model and its full softmax (engine_support.bare_model).

target_prompt_logprobs, prompt_logprobs_last_n, prompt_alt_tokens_k, topk_sample_logprobs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import PROMPT, TINY, bare_model

from treadle.engine import Engine, PromptTargets, SamplingSpec
from treadle.platform.errors import ValidationError

ONE_STEP = SamplingSpec(max_tokens=1, temperature=0.0, stop=())


def full_logprobs(cache_dir: Path, tokens: list[int]) -> torch.Tensor:
    """log softmax of the bare model's logits after each prefix of `tokens`: [len, V]."""
    with torch.no_grad():
        logits_T_V = bare_model(cache_dir)(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits_T_V, dim=-1)


# -- prompt_logprobs_last_n ---------------------------------------------------------------------


@pytest.mark.parametrize("last_n", [1, 3, len(PROMPT) - 1])
def test_last_n_is_the_tail_of_the_full_prompt_logprobs(engine: Engine, last_n: int) -> None:
    full = engine.sample(TINY, None, PROMPT, 1, ONE_STEP, prompt_logprobs=True)
    tail = engine.sample(
        TINY,
        None,
        PROMPT,
        1,
        ONE_STEP,
        prompt_logprobs=True,
        topk_prompt_logprobs=2,
        prompt_logprobs_last_n=last_n,
    )
    assert full.prompt_logprobs is not None and tail.prompt_logprobs is not None
    cut = len(PROMPT) - last_n
    assert tail.prompt_logprobs[:cut] == [None] * cut
    np.testing.assert_allclose(
        np.asarray(tail.prompt_logprobs[cut:], np.float64),
        np.asarray(full.prompt_logprobs[cut:], np.float64),
        atol=1e-6,
    )
    assert tail.topk_prompt_logprobs is not None
    assert tail.topk_prompt_logprobs[:cut] == [[]] * cut
    assert all(len(row) == 2 for row in tail.topk_prompt_logprobs[cut:])
    assert tail.sequences[0].tokens == full.sequences[0].tokens  # decoding starts the same


# -- target_prompt_logprobs ---------------------------------------------------------------------


def test_dense_target_ids_get_their_logprobs_and_minus_one_gets_zero(
    engine: Engine, cache_dir: Path
) -> None:
    rows = len(PROMPT) - 1
    ids_R_K = np.array([[PROMPT[r + 1], (r * 977) % 49152, -1] for r in range(rows)])
    ids_R_K[0, :2] = -1  # a row that asks for nothing
    targets = PromptTargets(rows=rows, k=3, ids=tuple(int(i) for i in ids_R_K.reshape(-1)))

    result = engine.sample(
        TINY, None, PROMPT, 1, ONE_STEP, prompt_logprobs=True, target_prompt_logprobs=targets
    )

    lp_P_V = full_logprobs(cache_dir, PROMPT)
    assert result.target_prompt_logprobs is not None and result.prompt_logprobs is not None
    got_R_K = np.asarray(result.target_prompt_logprobs).reshape(rows, 3)
    for r in range(rows):
        for c in range(3):
            token = int(ids_R_K[r, c])
            expected = 0.0 if token == -1 else float(lp_P_V[r, token])
            assert got_R_K[r, c] == pytest.approx(expected, abs=1e-5)
    # the prompt's own next token, named as a target, scores what prompt_logprobs says
    np.testing.assert_allclose(got_R_K[1:, 0], result.prompt_logprobs[2:], atol=1e-6)


def test_sparse_target_ids_are_scored_cell_by_cell(engine: Engine, cache_dir: Path) -> None:
    rows, k = len(PROMPT) - 1, 4
    cells = {(1, 0): 17, (1, 3): 4001, (3, 2): PROMPT[4], (4, 1): -1}  # (row, col) -> id
    crow = [sum(1 for (r, _) in cells if r < row) for row in range(rows + 1)]
    ordered = sorted(cells)
    targets = PromptTargets(
        rows=rows,
        k=k,
        ids=tuple(cells[cell] for cell in ordered),
        crow_indices=tuple(crow),
        col_indices=tuple(c for _, c in ordered),
    )

    result = engine.sample(TINY, None, PROMPT, 1, ONE_STEP, target_prompt_logprobs=targets)

    lp_P_V = full_logprobs(cache_dir, PROMPT)
    expected = [0.0 if cells[(r, c)] == -1 else float(lp_P_V[r, cells[(r, c)]]) for r, c in ordered]
    assert result.target_prompt_logprobs is not None
    np.testing.assert_allclose(result.target_prompt_logprobs, expected, atol=1e-5)
    assert result.prompt_logprobs is None  # only what was asked for


# -- prompt_alt_tokens_k ------------------------------------------------------------------------


def test_alt_tokens_are_draws_with_their_full_softmax_logprobs(
    engine: Engine, cache_dir: Path
) -> None:
    k = 6
    params = SamplingSpec(max_tokens=3, temperature=1.0, seed=9, stop=())
    result = engine.sample(TINY, None, PROMPT, 1, params, prompt_alt_tokens_k=k)
    again = engine.sample(TINY, None, PROMPT, 1, params, prompt_alt_tokens_k=k)
    plain = engine.sample(TINY, None, PROMPT, 1, params)

    tokens, logprobs = result.prompt_alt_tokens, result.prompt_alt_logprobs
    assert tokens is not None and logprobs is not None
    assert len(tokens) == len(PROMPT) - 1 and all(len(row) == k for row in tokens)
    lp_P_V = full_logprobs(cache_dir, PROMPT)
    for r, (row_tokens, row_lps) in enumerate(zip(tokens, logprobs, strict=True)):
        np.testing.assert_allclose(row_lps, lp_P_V[r, row_tokens].numpy(), atol=1e-5)
    assert len({t for row in tokens for t in row}) > len(tokens)  # draws, not one token per row
    assert (tokens, logprobs) == (again.prompt_alt_tokens, again.prompt_alt_logprobs)  # seeded
    assert result.sequences[0].tokens == plain.sequences[0].tokens  # sampling is unchanged


def test_greedy_alt_tokens_are_the_likeliest_token(engine: Engine, cache_dir: Path) -> None:
    result = engine.sample(TINY, None, PROMPT, 1, ONE_STEP, prompt_alt_tokens_k=3)
    lp_P_V = full_logprobs(cache_dir, PROMPT)
    best_R = lp_P_V[:-1].argmax(dim=-1).tolist()
    assert result.prompt_alt_tokens == [[b, b, b] for b in best_R]


# -- topk_sample_logprobs -----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_topk_sample_logprobs_are_the_top_of_the_sampling_softmax(
    engine: Engine, cache_dir: Path, temperature: float
) -> None:
    k = 4
    params = SamplingSpec(max_tokens=5, temperature=temperature, seed=3, stop=())
    result = engine.sample(TINY, None, PROMPT, 2, params, topk_sample_logprobs=k)

    for seq in result.sequences:
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
        with torch.no_grad():
            logits_T_V = bare_model(cache_dir)(torch.tensor([PROMPT + seq.tokens])).logits[0]
        scaled_T_V = logits_T_V.float() / (temperature or 1.0)
        lp_T_V = torch.log_softmax(scaled_T_V, dim=-1)[len(PROMPT) - 1 : -1]
        for j, (token, lp, top) in enumerate(
            zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True)
        ):
            values, ids = lp_T_V[j].topk(k)
            assert [t for t, _ in top] == ids.tolist()
            np.testing.assert_allclose([v for _, v in top], values.numpy(), atol=1e-5)
            if token in dict(top):  # the sampled token's own logprob is the same number
                assert dict(top)[token] == pytest.approx(lp, abs=1e-6)
    assert result.sequences[0].topk_logprobs is not None
    plain = engine.sample(TINY, None, PROMPT, 1, params)
    assert plain.sequences[0].topk_logprobs is None  # only what was asked for


# -- refusals -------------------------------------------------------------------------------------


def _targets(rows: int, ids: list[int], **csr: tuple[int, ...]) -> PromptTargets:
    return PromptTargets(rows=rows, k=len(ids) // rows if not csr else 2, ids=tuple(ids), **csr)


ROWS = len(PROMPT) - 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt_logprobs_last_n": 2}, "applies to prompt logprobs"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "between 1 and"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": len(PROMPT)}, "between 1 and"),
        ({"target_prompt_logprobs": _targets(ROWS + 1, [3] * (ROWS + 1))}, "shape"),
        ({"target_prompt_logprobs": _targets(ROWS, [-1] * ROWS)}, "names no token id"),
        ({"target_prompt_logprobs": _targets(ROWS, [49152] * ROWS)}, "not a token id"),
        ({"target_prompt_logprobs": _targets(ROWS, [-2] * ROWS)}, "not a token id"),
        (
            {"target_prompt_logprobs": _targets(ROWS, [5], crow_indices=(0, 1), col_indices=(0,))},
            "sparse CSR",
        ),
        (
            {
                "target_prompt_logprobs": _targets(
                    ROWS, [5], crow_indices=(0,) * ROWS + (1,), col_indices=(2,)
                )
            },
            "column index",
        ),
        ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k"),
        ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
    ],
)
def test_bad_scoring_requests_are_refused_by_name(
    engine: Engine, kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValidationError, match=match):
        engine.sample(TINY, None, PROMPT, 1, ONE_STEP, **kwargs)  # type: ignore[arg-type]
