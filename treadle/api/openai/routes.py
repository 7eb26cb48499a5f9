"""OpenAI-compatible routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Each request is an ordinary Sample (admitted with `submit`, metered, quota-checked, batched),
on a sampler of the caller's model (`openai_models`); its answer waits on the operation's done
notice like retrieve_future, or streams its tokens as server-sent events (`progress`). Errors
on /v1/ are OpenAI's {"error": {message, type, param, code}}. Imports platform only; never torch.
"""

from __future__ import annotations

import json
import time
from typing import Any

from flask import Blueprint, Response, jsonify, request

from treadle.api import errors as api_errors
from treadle.api.admission import submit
from treadle.api.context import json_body, principal, services
from treadle.api.openai.answers import Shape
from treadle.api.openai.schemas import ChatCompletionRequest, CompletionRequest, ParamError, parse
from treadle.platform import db
from treadle.platform.errors import LimitError, TreadleError, UnavailableError, ValidationError
from treadle.platform.eventlog import progress
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.operations import commands, operations
from treadle.platform.serving import openai_models, openai_serving

bp = Blueprint("openai", __name__, url_prefix="/v1")

WAIT_SECONDS = 600  # a sample that takes longer answers 504; its result stays retrievable
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
          402: "insufficient_quota", 429: "rate_limit_exceeded"}  # fmt: skip


@bp.errorhandler(TreadleError)
def openai_error(exc: TreadleError) -> Any:
    """Every refusal on /v1/ in OpenAI's error format, with its status."""
    if isinstance(exc, UnavailableError):
        response = api_errors.unavailable(exc, services().config.long_poll_seconds)
    elif isinstance(exc, LimitError):
        response = api_errors.refused_by_quota(exc)
    else:
        response = jsonify()
        response.status_code = exc.status
    kind = "server_error" if exc.status >= 500 else _TYPES.get(exc.status, "invalid_request_error")
    code: str | None = exc.code
    message = exc.message
    if exc.status == 404 and "/v1/models" not in request.path:
        code = "model_not_found"
    elif exc.status == 401:
        code = "invalid_api_key"
        message = message.replace("in the X-API-Key header", "as Authorization: Bearer <key>")
    param = exc.param if isinstance(exc, ParamError) else ("model" if exc.status == 404 else None)
    response.set_data(json.dumps({"error": {"message": message, "type": kind,
                                            "param": param, "code": code}}))  # fmt: skip
    response.mimetype = "application/json"
    return response


@bp.get("/models")
def list_models() -> Any:
    with db.reading(services().db) as conn:
        models = openai_models.listed(conn, principal())
    return jsonify(object="list", data=[
        {"id": model, "object": "model", "created": 0, "owned_by": owner}
        for model, owner in models
    ])  # fmt: skip


@bp.post("/completions")
def completions() -> Any:
    body = parse(CompletionRequest, json_body())
    target = _target(body.model)
    cache = services().config.cache_dir
    model = services().models.get(target.base_model)
    tokens = openai_serving.prompt_tokens(model, cache, body.prompt)
    k = body.logprobs
    return _serve(body, target, tokens, k or 0, chat=False, want_logprobs=k is not None,
                  max_tokens=body.max_tokens or openai_serving.DEFAULT_COMPLETION_TOKENS)  # fmt: skip


@bp.post("/chat/completions")
def chat_completions() -> Any:
    body = parse(ChatCompletionRequest, json_body())
    if body.top_logprobs and not body.logprobs:
        raise ParamError("top_logprobs needs logprobs: true", "top_logprobs")
    target = _target(body.model)
    messages = [{"role": m.role if m.role != "developer" else "system", "content": m.content}
                for m in body.messages]  # fmt: skip
    model = services().models.get(target.base_model)
    tokens = openai_serving.chat_tokens(model, services().config.cache_dir, messages)
    max_tokens = body.max_completion_tokens or body.max_tokens
    return _serve(body, target, tokens, body.top_logprobs or 0, chat=True,
                  want_logprobs=body.logprobs,
                  max_tokens=max_tokens or openai_serving.DEFAULT_CHAT_TOKENS)  # fmt: skip


def _target(model: str) -> openai_models.Target:
    try:
        with db.reading(services().db) as conn:
            return openai_models.resolve(conn, principal(), model)
    except ValidationError as exc:  # a session without sampler weights, a training checkpoint
        raise ParamError(exc.message, "model") from None


def _serve(body: CompletionRequest | ChatCompletionRequest, target: openai_models.Target,
           tokens: list[int], top_k: int, *, chat: bool, want_logprobs: bool,
           max_tokens: int) -> Any:  # fmt: skip
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
    sampler, session_id = openai_models.sampler_for(svc.deps, who, target)
    with svc.db.begin() as conn:
        seq = openai_models.next_seq(conn, sampler)
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
    )
    if not body.stream:
        admission = submit(session_id, seq, payload, sampler_id=sampler)
        op = _wait(admission.request_id)
        return jsonify(shape.answer(op.result))

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
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    events = shape.stream(
        svc.redis, follower, admission.request_id, include_usage, who, svc.db, svc.deps
    )
    return Response(events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})


def _wait(request_id: str) -> operations.OperationRow:
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
