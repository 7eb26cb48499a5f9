"""OpenAI-compatible sampling, without HTTP: prompts to token ids (a chat through the model's
chat template, with tools and tool calls in the model's own format: `treadle.client.tool_calls`,
shared with the SDK), the Sample payload, and a sample result as OpenAI choices, logprobs and
usage.

Both catalogue models use SmolLM2's tokenizer and its ChatML chat template, so tiny-debug chats
too. Text is decoded without special tokens (the EOS a chat stops on is not shown) and cut at the
first stop string, which OpenAI never returns. Imports nothing from api, engine, worker, flask or
torch (transformers is loaded lazily, by `tokenizers.load_tokenizer`); of the client, only
`tool_calls`, which loads neither transformers nor the tinker SDK.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from treadle.client import tool_calls
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import optypes
from treadle.platform.eventlog.results import SampledSequence
from treadle.platform.models import tokenizers, validation
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.serving.openai_models import Target

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = (
    256  # OpenAI's chat default is "up to the context"; a random model seldom stops
)


@functools.lru_cache(maxsize=8)
def tokenizer(model: BaseModelInfo, cache_dir: Path) -> Any:
    """`model`'s tokenizer, loaded once per process (loading takes seconds)."""
    return tokenizers.load_tokenizer(model, cache_dir)


def chat_tokens(
    model: BaseModelInfo,
    cache_dir: Path,
    messages: Sequence[Mapping[str, Any]],
    *,
    continue_final: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    prefill: str = "",
) -> list[int]:
    """The token ids of `messages` through the model's chat template, ready for the reply;
    `continue_final`: the last (assistant) message left open, the reply continuing its text.
    `tools` are offered in the model's own format (`tool_calls.render_text`), and `prefill`
    opens the reply (the start of a tool call that `tool_choice` asks for)."""
    tok = tokenizer(model, cache_dir)
    if not tok.chat_template:
        raise ValidationError(
            f"model {model.name} has no chat template; use /v1/completions with a prompt"
        )
    try:
        if continue_final:
            text = tok.apply_chat_template(
                list(messages),
                add_generation_prompt=False,
                continue_final_message=True,
                tokenize=False,
            )
        else:
            text = tool_calls.render_text(tok, messages, tools, add_generation_prompt=True)
            text += prefill
    except Exception as exc:  # the template's own refusal (raise_exception), or transformers'
        if not isinstance(exc, ValueError | TypeError) and "jinja2" not in type(exc).__module__:
            raise
        raise ValidationError(
            f"model {model.name}'s chat template cannot render these messages: {exc}"
        ) from None
    return list(tok.encode(text, add_special_tokens=False))


def call_format(model: BaseModelInfo, cache_dir: Path) -> str:
    """The format `model` writes tool calls in (`tool_calls.HERMES`); a 400 for a chat template
    that renders tools in a format the server cannot parse."""
    try:
        return tool_calls.tool_call_format(tokenizer(model, cache_dir))
    except tool_calls.ToolFormatError as exc:
        raise ValidationError(f"model {model.name}: {exc}; leave tools out") from None


def prompt_tokens(model: BaseModelInfo, cache_dir: Path, prompt: str) -> list[int]:
    return list(tokenizer(model, cache_dir).encode(prompt, add_special_tokens=False))


def payload(
    target: Target,
    model: BaseModelInfo,
    tokens: list[int],
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    n: int,
    seed: int | None,
    stop: list[str] | None,
    top_logprobs: int,
    top_k: int = -1,
) -> optypes.Sample:
    """The Sample of one OpenAI (or Anthropic) request (validated like asample's)."""
    validation.validate_prompt(tokens, model, max_tokens)
    return optypes.Sample(
        prompt=tokens,
        snapshot_id=target.snapshot_id,
        checkpoint_prefix=target.checkpoint_prefix,
        num_samples=n,
        prompt_logprobs=False,
        params=optypes.SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
        ),
        topk_sample_logprobs=top_logprobs,
    )


class Decoder:
    """One sample's text as its tokens come: each `feed` returns the text it adds (the text of
    all tokens so far minus what was already returned), held back while a stop string may be
    forming or a multi-byte character is incomplete."""

    def __init__(self, tok: Any, stop: list[str] | None) -> None:
        self._tok = tok
        self._stop = stop or []
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def text(self) -> str:
        """The whole text so far, cut at the first stop string."""
        text: str = self._tok.decode(self.tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in self._stop if s in text]
        return text[: min(cuts)] if cuts else text

    def feed(self, tokens: Sequence[int], *, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        text = self.text()
        full: str = self._tok.decode(self.tokens, skip_special_tokens=True)
        if len(text) < len(full):
            self.stopped = True  # a stop string appeared: nothing after it is ever sent
        elif not final:
            hold = max((len(s) - 1 for s in self._stop), default=0)
            text = text[: len(text) - hold] if hold else text
            text = text.rstrip("\ufffd")  # a character whose bytes are not all decoded yet
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


def token_text(tok: Any, token: int) -> str:
    return str(tok.decode([token]))


def chat_logprobs(tok: Any, tokens: Sequence[int], logprobs: Sequence[float],
                  topk: Sequence[Sequence[Sequence[float]]] | None) -> dict[str, Any]:  # fmt: skip
    """OpenAI chat `logprobs`: per sampled token its text, bytes, logprob and top_logprobs."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tok, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        top = [] if topk is None else [entry(int(t), float(lp)) for t, lp in topk[i]]
        content.append(entry(int(token), float(logprob)) | {"top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tok: Any, tokens: Sequence[int], logprobs: Sequence[float],
                        topk: Sequence[Sequence[Sequence[float]]] | None) -> dict[str, Any]:  # fmt: skip
    """OpenAI completions `logprobs`: tokens are the tokenizer's own token strings
    (`convert_tokens_to_ids` maps them back to ids)."""
    names = tok.convert_ids_to_tokens([int(t) for t in tokens])
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token_text(tok, int(token)))
    return {
        "tokens": names,
        "token_logprobs": [float(lp) for lp in logprobs],
        "top_logprobs": None if topk is None else [
            {tok.convert_ids_to_tokens(int(t)): float(lp) for t, lp in row} for row in topk
        ],
        "text_offset": offsets,
    }  # fmt: skip


def usage(prompt: int, sequences: Sequence[SampledSequence]) -> dict[str, int]:
    completion = sum(len(s.tokens) for s in sequences)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip
