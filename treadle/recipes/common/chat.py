"""Chat rendering with the model's own chat template, and the datums the recipes train on.

Position i of a datum's input predicts token i+1, so every datum is built from one token list:
input = tokens[:-1], targets = tokens[1:], and per-token inputs (weights, logprobs, advantages)
are aligned with the targets: a prompt of P tokens contributes P-1 zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinker import types

Messages = list[dict[str, str]]


def prompt_tokens(tokenizer: Any, messages: Messages) -> list[int]:
    """The conversation so far, ending where the assistant's reply begins."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def reply_tokens(tokenizer: Any, reply: str) -> list[int]:
    """An assistant reply as the model should produce it: the text, then end of turn."""
    return [int(t) for t in tokenizer.encode(reply, add_special_tokens=False)] + [
        int(tokenizer.eos_token_id)
    ]


def supervised_datum(tokenizer: Any, messages: Messages, reply: str) -> types.Datum:
    """Cross-entropy on the reply only: weight 1 on its tokens, 0 on the prompt's."""
    prompt = prompt_tokens(tokenizer, messages)
    completion = reply_tokens(tokenizer, reply)
    return datum(prompt, completion, weights=[1.0] * len(completion))


def datum(
    prompt: Sequence[int], completion: Sequence[int], **per_token: Sequence[float]
) -> types.Datum:
    """prompt + completion as one datum; each `per_token` list covers the completion only.

    Example: `datum(p, c, logprobs=sampler_lps, advantages=[a] * len(c))` for the RL losses.
    """
    tokens = [*prompt, *completion]
    pad = [0.0] * (len(prompt) - 1)
    inputs: dict[str, Any] = {"target_tokens": tokens[1:]}
    for name, values in per_token.items():
        if len(values) != len(completion):
            raise ValueError(
                f"{name} has {len(values)} values for a completion of {len(completion)} tokens"
            )
        inputs[name] = [*pad, *(float(v) for v in values)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def completion_text(tokenizer: Any, tokens: Sequence[int]) -> str:
    return str(tokenizer.decode(list(tokens), skip_special_tokens=True))
