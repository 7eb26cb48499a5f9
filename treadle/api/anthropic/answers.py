"""Anthropic answers of a sample: the whole message, or its server-sent events as the Anthropic
API sends them (message_start, content_block_start, ping, content_block_delta with text_delta
as tokens come, content_block_stop, message_delta with stop_reason and usage, message_stop).

The reply is one text block, decoded without special tokens and cut before the first stop
sequence. stop_reason: "stop_sequence" (naming it) when a stop sequence ended the text,
"end_turn" when the model stopped on its own, "max_tokens" otherwise. usage counts the tokens
metered: input_tokens the prompt's (prefill), output_tokens the sampled ones. A client that goes
away cancels the sample (`answers.cancel_abandoned`, as the OpenAI streams do).
Imports platform only; never torch.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from treadle.api.chat.answers import cancel_abandoned
from treadle.platform import db
from treadle.platform.eventlog import progress
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.eventlog.results import SampledSequence, SampleOutput
from treadle.platform.operations import operations
from treadle.platform.serving.openai_serving import Decoder
from treadle.platform.tenancy.tenants import Principal


@dataclass(frozen=True)
class Reply:
    """How one Messages request's sample is answered."""

    model: str
    stop: list[str] | None
    input_tokens: int
    tok: Any  # the model's tokenizer

    def _head(self) -> dict[str, Any]:
        return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                "model": self.model}  # fmt: skip

    def _usage(self, output_tokens: int) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0, "output_tokens": output_tokens}  # fmt: skip

    def _stop_reason(self, seq: SampledSequence, decoder: Decoder) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of a finished sample."""
        if decoder.stopped and self.stop:
            full: str = self.tok.decode(decoder.tokens, skip_special_tokens=True)
            first = min((full.find(s), i) for i, s in enumerate(self.stop) if s in full)
            return "stop_sequence", self.stop[first[1]]
        return ("end_turn" if seq.stop_reason == "stop" else "max_tokens"), None

    def message(self, stored: Mapping[str, Any]) -> dict[str, Any]:
        """The whole message of a sample whose stored result is `stored`."""
        seq = SampleOutput.model_validate(stored).sequences[0]
        decoder = Decoder(self.tok, self.stop)
        decoder.feed(seq.tokens, final=True)
        reason, sequence = self._stop_reason(seq, decoder)
        return self._head() | {
            "content": [{"type": "text", "text": decoder.text()}],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self._usage(len(seq.tokens)),
        }

    def stream(self, redis: Any, follower: progress.Follow, request_id: str, who: Principal,
               engine: Any, deps: Any) -> Iterator[str]:  # fmt: skip
        """The SSE events of streamed request `request_id` (its Follow already entered)."""
        decoder, streamed, done = Decoder(self.tok, self.stop), 0, False
        try:
            start = self._head() | {"content": [], "stop_reason": None, "stop_sequence": None,
                                    "usage": self._usage(0)}  # fmt: skip
            yield _event("message_start", {"type": "message_start", "message": start})
            yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}})  # fmt: skip
            yield _event("ping", {"type": "ping"})
            for message in follower:
                tokens = list(message["tokens"])
                streamed += len(tokens)
                text = decoder.feed(tokens)
                if text:
                    yield _delta(text)
            with db.reading(engine) as conn:
                op = operations.get_operation(conn, who, request_id)
            done = True
            if op.status != OpStatus.COMPLETED:
                error = op.error or {}
                kind = "invalid_request_error" if error.get("category") == "user" else "api_error"
                said = str(error.get("message", "the sample did not finish"))
                yield _event("error", {"type": "error",
                                       "error": {"type": kind, "message": said}})  # fmt: skip
                return
            seq = SampleOutput.model_validate(op.result).sequences[0]
            text = decoder.feed(seq.tokens[streamed:], final=True)
            if text:
                yield _delta(text)
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            reason, sequence = self._stop_reason(seq, decoder)
            yield _event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": len(seq.tokens)},
            })  # fmt: skip
            yield _event("message_stop", {"type": "message_stop"})
        finally:
            follower.close()
            if not done:  # the client went away (GeneratorExit) or the wait failed
                cancel_abandoned(redis, deps, who, request_id)


def _delta(text: str) -> str:
    return _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": text}})  # fmt: skip


def _event(name: str, data: Mapping[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"
