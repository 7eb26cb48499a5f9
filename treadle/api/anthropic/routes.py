"""Anthropic Messages routes: POST /anthropic/api/v1/messages (a message, or its server-sent
events with `stream: true`) and POST /anthropic/api/v1/messages/count_tokens.

`model` names what the OpenAI-compatible routes serve (a live session with sampler weights, a
`tinker://.../sampler_weights/...` checkpoint, a base model; `openai_models`); the conversation
goes through the model's chat template, and the request is an ordinary Sample admitted,
metered and quota-checked like theirs (`treadle.api.chat.serving`). A final assistant message is
a prefill: the reply continues it. The key comes as `x-api-key` or `Authorization: Bearer`
(the app's authentication hook). Every refusal is Anthropic's
`{"type": "error", "error": {"type", "message"}}` with its status. Imports platform only.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from flask import Blueprint, Response, jsonify
from werkzeug.exceptions import HTTPException

from treadle.api import errors as api_errors
from treadle.api.anthropic import answers, schemas
from treadle.api.chat import serving
from treadle.api.context import json_body, principal, services
from treadle.platform import db
from treadle.platform.errors import LimitError, TreadleError, UnavailableError
from treadle.platform.models import validation
from treadle.platform.serving import openai_models, openai_serving

log = logging.getLogger(__name__)

bp = Blueprint("anthropic", __name__, url_prefix="/anthropic/api/v1")

# Anthropic's error types by status (its API's errors page); other 4xx are invalid requests.
_TYPES = {401: "authentication_error", 402: "billing_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 504: "timeout_error"}  # fmt: skip


@bp.errorhandler(Exception)
def anthropic_error(exc: Exception) -> Any:
    """Every refusal and failure on /anthropic/ in Anthropic's error shape, with its status."""
    if not isinstance(exc, TreadleError | HTTPException):
        exc = api_errors.dependency_failure(exc) or exc  # PostgreSQL, Redis down: a 503
    if isinstance(exc, UnavailableError):
        response = api_errors.unavailable(exc, services().config.long_poll_seconds)
    elif isinstance(exc, LimitError):
        response = api_errors.refused_by_quota(exc)
    else:
        response = jsonify()
        if isinstance(exc, TreadleError):
            response.status_code = exc.status
        elif isinstance(exc, HTTPException):
            response.status_code = exc.code or 500
        else:
            response.status_code = 500
    status = response.status_code
    if isinstance(exc, TreadleError):
        message = exc.message.replace(
            "in the X-API-Key header", "in the x-api-key header (or as Authorization: Bearer)"
        )
    elif isinstance(exc, HTTPException):
        message = exc.description or exc.name
    else:
        log.exception("unhandled error on an Anthropic route")
        message = "internal server error"
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    response.set_data(json.dumps({"type": "error", "error": {"type": kind, "message": message}}))
    response.mimetype = "application/json"
    return response


@bp.post("/messages")
def messages() -> Any:
    body = schemas.parse(schemas.MessagesRequest, json_body())
    target, tokens = _prompt(body)
    svc, stops = services(), body.stops()
    model = svc.models.get(target.base_model)
    top_k, top_p = body.top_k or -1, 1.0 if body.top_p is None else body.top_p
    validation.check_sampling(1, body.temperature, top_k, top_p, body.seed, stops or [])
    payload = openai_serving.payload(
        target, model, tokens, max_tokens=body.max_tokens, temperature=body.temperature,
        top_p=top_p, top_k=top_k, n=1, seed=body.seed, stop=stops, top_logprobs=0,
    )  # fmt: skip
    request_id, follower = serving.admit(target, payload, stream=body.stream)
    reply = answers.Reply(
        body.model, stops, len(tokens), openai_serving.tokenizer(model, svc.config.cache_dir)
    )
    if follower is None:
        return jsonify(reply.message(serving.wait(request_id).result))
    events = reply.stream(svc.redis, follower, request_id, principal(), svc.db, svc.deps)
    return Response(events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})


@bp.post("/messages/count_tokens")
def count_tokens() -> Any:
    """The prompt tokens the same conversation is metered with as a message's input_tokens."""
    body = schemas.parse(schemas.CountTokensRequest, json_body())
    _, tokens = _prompt(body)
    return jsonify(input_tokens=len(tokens))


def _prompt(body: schemas.CountTokensRequest | schemas.MessagesRequest) -> tuple[
        openai_models.Target, list[int]]:  # fmt: skip
    """What serves `body.model`, and the conversation's token ids through its chat template."""
    with db.reading(services().db) as conn:
        target = openai_models.resolve(conn, principal(), body.model)
    model = services().models.get(target.base_model)
    tokens = openai_serving.chat_tokens(
        model, services().config.cache_dir, body.chat(), continue_final=body.is_prefill
    )
    return target, tokens
