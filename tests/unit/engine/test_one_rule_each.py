"""Admission and the engine hold a request to the same rules (`treadle.platform.models.validation`):
the same bad datum or sample request gets the same message whether the API refuses it before
anything is appended or the engine is handed it directly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from treadle.engine.losses.functions import EngineDatum, get_loss, validate_data
from treadle.engine.sampling.prompt_scores import PromptScoring, PromptTargets
from treadle.engine.sampling.rules import SamplingSpec, validate_sampling
from treadle.platform.errors import ValidationError
from treadle.platform.models import validation
from treadle.platform.models.catalog import TINY_DEBUG_NAME, get_base_model

MODEL = get_base_model(TINY_DEBUG_NAME)
V = MODEL.vocab_size


def _tensor(values: list[Any], dtype: str) -> dict[str, Any]:
    return {"dtype": dtype, "shape": [len(values)], "data": values}


def _rl(**override: list[Any] | None) -> tuple[list[int], dict[str, tuple[list[Any], str]]]:
    inputs: dict[str, tuple[list[Any], str]] = {
        "target_tokens": ([2, 3, 4], "int64"),
        "logprobs": ([-1.0] * 3, "float32"),
        "advantages": ([1.0] * 3, "float32"),
    }
    for name, values in override.items():
        if values is None:
            del inputs[name]
        else:
            inputs[name] = (values, "int64" if name == "target_tokens" else "float32")
    return [1, 2, 3], inputs


CASES = {
    "empty": ("ppo", ([], {})),
    "too long": ("cross_entropy", ([1] * 2049, {})),
    "token past the vocabulary": ("ppo", ([1, V, 3], _rl()[1])),
    "negative token": ("ppo", ([1, -1, 3], _rl()[1])),
    "token past 64 bits": ("ppo", ([1, 2**70, 3], _rl()[1])),
    "missing advantages": ("ppo", _rl(advantages=None)),
    "weights on dro": ("dro", _rl(weights=[1.0] * 3)),
    "short weights": ("ppo", _rl(weights=[1.0, 0.0])),
    "target past the vocabulary": ("ppo", _rl(target_tokens=[2, 3, V + 5])),
    "clip out of range": ("ppo", _rl(clip_high_threshold=[1.2, 11.0, 1.2])),
    "empty mask": ("gspo", _rl(sequence_ratio_mask=[0.0] * 3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_datum_gets_the_same_message_at_admission_and_in_the_engine(case: str) -> None:
    loss_fn, (tokens, inputs) = CASES[case]
    payload = {
        "loss_fn": loss_fn,
        "loss_fn_config": {},
        "data": [{"tokens": tokens, "loss_fn_inputs": {k: _tensor(*v) for k, v in inputs.items()}}],
    }
    with pytest.raises(ValidationError) as admitted:
        validation.validate_forward_backward(payload, MODEL)
    datum = EngineDatum(
        tuple(tokens),
        {
            k: np.asarray(v, object if any(abs(x) >= 2**63 for x in v) else d)
            for k, (v, d) in inputs.items()
        },
    )
    with pytest.raises(ValidationError) as engine:
        validate_data(
            [datum],
            get_loss(loss_fn),
            vocab_size=V,
            max_context_length=MODEL.max_context_length,
            model_name=MODEL.name,
        )
    assert str(engine.value) == str(admitted.value)


SAMPLES: dict[str, tuple[list[int], int, dict[str, Any]]] = {
    "empty prompt": ([], 4, {}),
    "prompt past the vocabulary": ([1, V], 4, {}),
    "past the context": ([1, 2, 3], MODEL.max_context_length, {}),
    "last_n without logprobs": ([1, 2, 3, 4], 1, {"last_n": 2}),
    "last_n too long": ([1, 2, 3, 4], 1, {"logprobs": True, "last_n": 4}),
    "too many draws": ([1] * 2000, 1, {"alt_k": 200}),
    "negative draws": ([1, 2, 3], 1, {"alt_k": -1}),
    "targets of the wrong shape": ([1, 2, 3], 1, {"targets": ([3, 2], [5] * 6, None, None)}),
    "targets naming nothing": ([1, 2, 3], 1, {"targets": ([2, 2], [-1] * 4, None, None)}),
    "targets past the vocabulary": ([1, 2, 3], 1, {"targets": ([2, 1], [5, V], None, None)}),
    "targets with bad CSR": ([1, 2, 3], 1, {"targets": ([2, 2], [5], [0, 1], [0])}),
    "targets with a bad column": ([1, 2, 3], 1, {"targets": ([2, 2], [5], [0, 0, 1], [2])}),
}


@pytest.mark.parametrize("case", list(SAMPLES))
def test_a_bad_sample_request_gets_the_same_message_at_admission_and_in_the_engine(
    case: str,
) -> None:
    prompt, max_tokens, options = SAMPLES[case]
    logprobs, last_n = options.get("logprobs", False), options.get("last_n")
    alt_k, targets = options.get("alt_k", 0), options.get("targets")
    with pytest.raises(ValidationError) as admitted:
        validation.validate_prompt(prompt, MODEL, max_tokens)
        table = None
        if targets is not None:
            shape, ids, crow, col = targets
            table = {
                "dtype": "int64",
                "shape": shape,
                "data": ids,
                "sparse_crow_indices": crow,
                "sparse_col_indices": col,
            }
        validation.validate_prompt_scoring(
            prompt,
            MODEL,
            prompt_logprobs=logprobs,
            topk=0,
            last_n=last_n,
            alt_tokens_k=alt_k,
            targets=table,
        )
    scoring = PromptScoring(
        logprobs=logprobs,
        last_n=last_n,
        alt_k=alt_k,
        targets=None
        if targets is None
        else PromptTargets(
            rows=targets[0][0],
            k=targets[0][1],
            ids=tuple(targets[1]),
            crow_indices=None if targets[2] is None else tuple(targets[2]),
            col_indices=None if targets[3] is None else tuple(targets[3]),
        ),
    )
    with pytest.raises(ValidationError) as engine:
        validate_sampling(
            prompt,
            1,
            SamplingSpec(max_tokens=max_tokens),
            vocab_size=V,
            max_context_length=MODEL.max_context_length,
            model_name=MODEL.name,
            scoring=scoring,
        )
    assert str(engine.value) == str(admitted.value)


def test_admission_changes_nothing_it_checks() -> None:
    tokens, inputs = _rl(weights=[1.0, 0.5, 0.0])
    payload = {
        "loss_fn": "ppo",
        "loss_fn_config": {},
        "data": [{"tokens": tokens, "loss_fn_inputs": {k: _tensor(*v) for k, v in inputs.items()}}],
    }
    before = repr(payload)
    validation.validate_forward_backward(payload, MODEL)
    assert repr(payload) == before
