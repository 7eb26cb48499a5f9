"""OpenAI answers of a sample: the whole response, or its server-sent event stream.

A streamed answer sends each sample's text as its tokens come (`progress.Follow`), then a chunk
with its finish_reason (and whatever the final result holds beyond what was streamed), a usage
chunk if asked, and `data: [DONE]`. A client that goes away closes the generator: the sample is
cancelled on the worker (`progress.cancel_streamed`) and, if still pending after a short grace,
in the database. A chat offered tools (`Calls`) answers the calls read from its text as
`tool_calls`, with finish_reason "tool_calls"; such a chat is never streamed.
Imports platform and `treadle.client.tool_calls` only; never torch.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.client import tool_calls
from treadle.platform import db
from treadle.platform.errors import TreadleError
from treadle.platform.eventlog import progress
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.eventlog.results import SampledSequence, SampleOutput
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.operations import futures, operations
from treadle.platform.serving import openai_serving
from treadle.platform.tenancy.tenants import Principal

log = logging.getLogger(__name__)

# How long a disconnected stream's request is left to the worker to stop before the database
# fails it (a step takes milliseconds; a request still queued is failed there).
CANCEL_GRACE_SECONDS = 2.0


@dataclass(frozen=True)
class Calls:
    """How a chat offered tools is answered: the tools, the text that opened the reply
    (`prefill`, part of the prompt: the start of the call `tool_choice` asks for) and whether
    more than one call is answered (`parallel`, OpenAI's parallel_tool_calls)."""

    tools: list[dict[str, Any]]
    prefill: str = ""
    parallel: bool = True

    def message(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """The assistant message of sampled `text` and its finish_reason: the calls read from
        it as `tool_calls` ("tool_calls"), or, when it holds none that can be read, its text
        as it is (the prefill included) with `finish`."""
        text = self.prefill + text
        try:
            content, calls = tool_calls.parse_tool_calls(tool_calls.HERMES, text, tools=self.tools)
        except tool_calls.ToolCallParseError:
            calls = []
        if not calls:
            return {"role": "assistant", "content": text, "refusal": None}, finish
        calls = calls if self.parallel else calls[:1]
        return {"role": "assistant", "content": content or None, "refusal": None,
                "tool_calls": [call.to_openai() for call in calls]}, "tool_calls"  # fmt: skip


@dataclass(frozen=True)
class Shape:
    model: str
    chat: bool
    want_logprobs: bool
    top_k: int
    stop: list[str] | None
    prompt_tokens: int
    base_model: BaseModelInfo
    cache_dir: Path
    n: int = 1  # choices: a chat stream opens each with the assistant's role
    calls: Calls | None = None  # a chat offered tools (never streamed)

    def _tok(self) -> Any:
        return openai_serving.tokenizer(self.base_model, self.cache_dir)

    def _logprobs(self, tokens: Any, logprobs: Any, topk: Any) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        topk = topk if self.top_k else None
        fn = openai_serving.chat_logprobs if self.chat else openai_serving.completion_logprobs
        return fn(self._tok(), tokens, logprobs, topk)

    def _head(self) -> dict[str, Any]:
        prefix, kind = (
            ("chatcmpl-", "chat.completion") if self.chat else ("cmpl-", "text_completion")
        )
        return {"id": prefix + secrets.token_hex(12), "object": kind,
                "created": int(time.time()), "model": self.model}  # fmt: skip

    def answer(self, stored: Mapping[str, Any]) -> dict[str, Any]:
        """The whole response to a sample whose stored result is `stored`."""
        result = SampleOutput.model_validate(stored)
        tok, choices = self._tok(), []
        for i, seq in enumerate(result.sequences):
            decoder = openai_serving.Decoder(tok, self.stop)
            decoder.feed(seq.tokens, final=True)
            finish = self._finish(seq, decoder)
            logprobs = self._logprobs(seq.tokens, seq.logprobs, seq.topk_logprobs)
            if self.chat:
                message = {"role": "assistant", "content": decoder.text(), "refusal": None}
                if self.calls is not None:
                    message, finish = self.calls.message(decoder.text(), finish)
                choices.append({"index": i, "message": message, "logprobs": logprobs,
                                "finish_reason": finish})  # fmt: skip
            else:
                choices.append({"index": i, "text": decoder.text(), "logprobs": logprobs,
                                "finish_reason": finish})  # fmt: skip
        usage = openai_serving.usage(self.prompt_tokens, result.sequences)
        return self._head() | {"choices": choices, "usage": usage}

    @staticmethod
    def _finish(seq: SampledSequence, decoder: openai_serving.Decoder) -> str:
        return "stop" if seq.stop_reason == "stop" or decoder.stopped else "length"

    def _chunk(self, head: dict[str, Any], i: int, text: str, logprobs: Any,
               finish: str | None) -> str:  # fmt: skip
        if self.chat:
            choice = {"index": i, "delta": {"content": text}, "logprobs": logprobs,
                      "finish_reason": finish}  # fmt: skip
            kind = "chat.completion.chunk"
        else:
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        return _event(head | {"object": kind, "choices": [choice]})

    def stream(self, deps_redis: Any, follower: progress.Follow, request_id: str,
               include_usage: bool, who: Principal, engine: Any, deps: Any) -> Iterator[str]:  # fmt: skip
        """The SSE events of streamed request `request_id` (its Follow already entered)."""
        head, tok = self._head(), self._tok()
        decoders: dict[int, openai_serving.Decoder] = {}
        counts: dict[int, int] = {}  # tokens of each sample streamed (as text)
        scored: dict[int, int] = {}  # of which their logprobs were sent
        done = False
        try:
            if self.chat:
                for i in range(self.n):
                    yield _event(head | {"object": "chat.completion.chunk", "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}]})  # fmt: skip
            for message in follower:
                i, tokens = int(message["sample"]), list(message["tokens"])
                decoder = decoders.setdefault(i, openai_serving.Decoder(tok, self.stop))
                text = decoder.feed(tokens)
                # progress carries no alternatives: with top_logprobs, the last chunk has them all
                logprobs = None if self.top_k else self._logprobs(tokens, message["logprobs"], None)
                counts[i] = counts.get(i, 0) + len(tokens)
                scored[i] = 0 if self.top_k else counts[i]
                if text or logprobs:
                    yield self._chunk(head, i, text, logprobs, None)
            with db.reading(engine) as conn:
                op = operations.get_operation(conn, who, request_id)
            done = True
            if op.status != OpStatus.COMPLETED:
                message = (op.error or {}).get("message", "the sample did not finish")
                yield _event({"error": {"message": message, "type": "server_error",
                                        "param": None, "code": None}})  # fmt: skip
                return
            result = SampleOutput.model_validate(op.result)
            for i, seq in enumerate(result.sequences):
                decoder = decoders.setdefault(i, openai_serving.Decoder(tok, self.stop))
                text = decoder.feed(seq.tokens[counts.get(i, 0) :], final=True)
                start, topk = scored.get(i, 0), seq.topk_logprobs
                logprobs = None
                if start < len(seq.tokens):
                    logprobs = self._logprobs(seq.tokens[start:], seq.logprobs[start:],
                                              topk[start:] if topk else None)  # fmt: skip
                yield self._chunk(head, i, text, logprobs, self._finish(seq, decoder))
            if include_usage:
                usage = openai_serving.usage(self.prompt_tokens, result.sequences)
                kind = "chat.completion.chunk" if self.chat else "text_completion"
                yield _event(head | {"object": kind, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            follower.close()
            if not done:  # the client went away (GeneratorExit) or the wait failed
                cancel_abandoned(deps_redis, deps, who, request_id)


def cancel_abandoned(redis: Any, deps: Any, who: Principal, request_id: str) -> None:
    """Stop a streamed request whose client went away: the worker ends a running (or queued)
    one at its next decoding step, failed "cancelled: the client disconnected"; one it has not
    settled within `CANCEL_GRACE_SECONDS` (no worker holds it yet) is failed in the database."""
    try:
        progress.cancel_streamed(redis, request_id)
        deadline = time.monotonic() + CANCEL_GRACE_SECONDS
        while time.monotonic() < deadline:
            with db.reading(deps.db) as conn:
                if operations.get_operation(conn, who, request_id).is_done:
                    return
            time.sleep(0.05)
        futures.cancel(deps, who, request_id)
    except TreadleError:
        pass  # settled meanwhile: nothing to cancel
    except Exception as exc:  # the worker's own checks end it later
        log.warning("could not cancel the streamed request %s: %s", request_id, exc)


def _event(data: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"
