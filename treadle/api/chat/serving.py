"""One chat or text completion: its Sample admitted on the sampler that serves its target, then
the whole answer once the sample settles, or its tokens streamed as server-sent events.

Each request is an ordinary Sample (admitted with `submit`, metered, quota-checked, batched); its
answer waits on the operation's done notice like retrieve_future, or follows the sample's
progress (`progress`). Refusals are raised as platform errors (ParamError naming the OpenAI
parameter); each surface answers them in its own error shape. Imports platform only; never
torch.
"""

from __future__ import annotations

import json
import time
from typing import Any

import sqlalchemy as sa
from flask import Response

from treadle.api.admission import submit
from treadle.api.chat.answers import Calls, Shape
from treadle.api.chat.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ParamError,
)
from treadle.api.context import principal, services
from treadle.client import tool_calls
from treadle.platform import db
from treadle.platform.errors import TreadleError, ValidationError
from treadle.platform.eventlog import optypes, progress
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.operations import commands, operations
from treadle.platform.serving import openai_models, openai_serving
from treadle.platform.sessions import sessions as sessions_core

WAIT_SECONDS = 600  # a sample that takes longer answers 504; its result stays retrievable


def chat(body: ChatCompletionRequest, target: openai_models.Target) -> Any:
    """Serve a chat completion request on `target` (a JSON answer or an SSE response)."""
    if body.top_logprobs and not body.logprobs:
        raise ParamError("top_logprobs needs logprobs: true", "top_logprobs")
    messages = [m.plain() for m in body.messages]
    try:
        tool_calls.normalise_messages(messages)
    except ValueError as exc:  # a call's arguments that are not a JSON object
        raise ParamError(str(exc), "messages") from None
    tools = body.offered_tools()
    model = services().models.get(target.base_model)
    cache_dir = services().config.cache_dir
    calls = None
    if tools:
        openai_serving.call_format(model, cache_dir)
        calls = Calls(tools, _prefill(body.tool_choice), body.parallel_tool_calls)
    prefill = calls.prefill if calls else ""
    tokens = openai_serving.chat_tokens(model, cache_dir, messages, tools=tools, prefill=prefill)
    max_tokens = body.max_completion_tokens or body.max_tokens
    return serve(body, target, tokens, body.top_logprobs or 0, chat=True,
                 want_logprobs=body.logprobs, calls=calls,
                 max_tokens=max_tokens or openai_serving.DEFAULT_CHAT_TOKENS)  # fmt: skip


def _prefill(choice: str | NamedToolChoice | None) -> str:
    """The opening of the reply that `tool_choice` asks for: a call ("required"), a call of the
    named function, or nothing ("auto"). Each ends where a byte-level BPE's pre-tokenizer splits
    the whole call's text (before the space of ` {`, after that of ` "`), so the prompt's
    tokens are those the model sees when it writes the call itself."""
    if isinstance(choice, NamedToolChoice):
        return f'<tool_call>\n{{"name": {json.dumps(choice.function.name)}, "arguments":'
    return '<tool_call>\n{"name": "' if choice == "required" else ""


def serve(body: CompletionRequest | ChatCompletionRequest, target: openai_models.Target,
          tokens: list[int], top_k: int, *, chat: bool, want_logprobs: bool,
          max_tokens: int, calls: Calls | None = None) -> Any:  # fmt: skip
    svc, who = services(), principal()
    stop = body.stops()
    try:
        payload = openai_serving.payload(
            target, svc.models.get(target.base_model), tokens, max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p, n=body.n, seed=body.seed, stop=stop, top_logprobs=top_k,
        )  # fmt: skip
    except ValidationError as exc:  # the prompt and max_tokens do not fit the model's context
        raise ParamError(exc.message, "max_tokens") from None
    shape = Shape(
        body.model,
        chat,
        want_logprobs,
        top_k,
        stop,
        len(tokens),
        svc.models.get(target.base_model),
        svc.config.cache_dir,
        body.n,
        calls,
    )
    request_id, follower = admit(target, payload, stream=body.stream)
    if follower is None:
        return shape.answer(wait(request_id).result)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    events = shape.stream(svc.redis, follower, request_id, include_usage, who, svc.db, svc.deps)
    return Response(events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})


def admit(
    target: openai_models.Target, payload: optypes.Sample, *, stream: bool
) -> tuple[str, progress.Follow | None]:
    """Admit `payload` on the sampler serving `target`: its request id, and for a stream the
    Follow of its progress (entered before the admission commits, so no token is missed; the
    caller's stream closes it). Every surface that serves chats admits through here."""
    svc, who = services(), principal()
    sampler, session_id = openai_models.sampler_for(svc.deps, who, target)

    def seq(conn: sa.Connection) -> int:  # allocated in the admission's transaction
        return sessions_core.next_sampler_seq(conn, sampler)

    if not stream:
        return submit(session_id, seq, payload, sampler_id=sampler).request_id, None

    def settled() -> bool:  # asked while no message comes: a lost done notice never hangs us
        with db.reading(svc.db) as conn:
            return operations.get_operation(conn, who, follower.request_id).is_done

    follower = progress.follow(svc.redis, "", timeout_seconds=WAIT_SECONDS, is_done=settled)

    def mark(admission: operations.Admission) -> None:  # before the commit: nothing is missed
        progress.want_progress(svc.redis, admission.request_id)
        follower.request_id = admission.request_id
        follower.__enter__()

    try:
        admission = commands.submit(
            svc.deps, who, session_id, seq, payload, sampler_id=sampler, on_admitted=mark
        )
    except BaseException:
        follower.close()
        raise
    return admission.request_id, follower


def wait(request_id: str) -> operations.OperationRow:
    """The settled operation `request_id`; its error raised if it failed."""
    svc, who = services(), principal()

    def check() -> operations.OperationRow | None:
        with db.reading(svc.db) as conn:
            op = operations.get_operation(conn, who, request_id)
        return op if op.is_done else None

    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        op = svc.notices.wait_until(request_id, check, svc.config.long_poll_seconds)
        if op is not None:
            if op.status == OpStatus.FAILED:
                raise _failed(op)
            return op
    raise progress.ProgressTimeoutError(f"request {request_id} did not finish in {WAIT_SECONDS} s")


def _failed(op: operations.OperationRow) -> TreadleError:
    error = TreadleError(str(op.error["message"]))
    error.status = 400 if op.error.get("category") == "user" else 500
    error.code = str(op.error.get("code") or "sample_failed")
    return error
