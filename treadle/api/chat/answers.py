"""OpenAI answers of a sample: the whole response, or its server-sent event stream.

A streamed answer sends each sample's text as its tokens come (`progress.Follow`), then a chunk
with its finish_reason (and whatever the final result holds beyond what was streamed), a usage
chunk if asked, and `data: [DONE]`. A client that goes away closes the generator: the sample is
cancelled on the worker (`progress.cancel_streamed`) and, if still pending after a short grace,
in the database. A chat offered tools (`Calls`) answers the calls read from its text as
`tool_calls`, with finish_reason "tool_calls"; streamed, its text goes out as content until a
call may have begun, and the calls go out whole at the end (`HeldCalls`).
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


class HeldCalls:
    """One streamed choice of a chat offered tools. Its text streams as content until a call
    may have begun (`MARK`, or the start of it at the end of the text so far; from the first
    token when the reply opens inside a call); the rest is held to the end, where `end` gives
    what is left of the content and the calls read from the whole text, each a whole
    `tool_calls` delta (as OpenAI streams them, with its index), or, when none can be read, the
    held text as content."""

    MARK = "<tool_call>"

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.text = ""
        self.sent = 0  # characters of `text` streamed as content
        self.holding = bool(calls.prefill)

    def feed(self, text: str) -> str:
        """The content that `text`, the choice's next text, lets stream now."""
        self.text += text
        if self.holding:
            return ""
        # nothing before `sent` can begin a call: a possible start of one is never sent
        at = self.text.find(self.MARK, self.sent)
        if at >= 0:
            self.holding, end = True, at
        else:
            end = len(self.text) - _partial_suffix(self.text, self.MARK)
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def end(self, finish: str) -> tuple[str, list[dict[str, Any]], str]:
        """The content not streamed yet, the calls' `tool_calls` deltas and the finish_reason."""
        message, finish = self.calls.message(self.text, finish)
        content, streamed = message.get("content") or "", self.text[: self.sent]
        rest = content[len(streamed) :] if content.startswith(streamed) else ""
        deltas = [{"index": j} | call for j, call in enumerate(message.get("tool_calls", []))]
        return rest, deltas, finish


def _partial_suffix(text: str, mark: str) -> int:
    """The length of the longest end of `text` that begins `mark` (0 if none)."""
    return next((n for n in range(min(len(mark) - 1, len(text)), 0, -1)
                 if mark.startswith(text[-n:])), 0)  # fmt: skip


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
    calls: Calls | None = None  # a chat offered tools

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
               finish: str | None, calls: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if calls:  # as OpenAI streams a call: its whole delta, and content null
                delta = {"content": text or None, "tool_calls": calls}
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
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
        held: dict[int, HeldCalls] = {}  # with tools: each choice's text until a call is read
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
                if self.calls is not None:
                    text = held.setdefault(i, HeldCalls(self.calls)).feed(text)
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
                finish, calls = self._finish(seq, decoder), None
                if self.calls is not None:
                    hold = held.setdefault(i, HeldCalls(self.calls))
                    text = hold.feed(text)
                    text, calls, finish = hold.end(finish)
                yield self._chunk(head, i, text, logprobs, finish, calls)
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
