"""OpenAI-compatible routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(the app factory registers the blueprint again at /oai/api/v1, Tinker's documented path).

Each request is an ordinary Sample on a sampler of the caller's model (`openai_models`), served
by `treadle.api.chat` (shared with SageMaker's SampleTrainingSession): the whole answer, or its
tokens as server-sent events. Errors on /v1/ are OpenAI's {"error": {message, type, param,
code}} on both paths. Imports platform only; never torch.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, Response, jsonify, request

from treadle.api import errors as api_errors
from treadle.api.chat import serving
from treadle.api.chat.schemas import ChatCompletionRequest, CompletionRequest, ParamError, parse
from treadle.api.context import json_body, principal, services
from treadle.platform import db
from treadle.platform.errors import LimitError, TreadleError, UnavailableError, ValidationError
from treadle.platform.serving import openai_models, openai_serving

bp = Blueprint("openai", __name__, url_prefix="/v1")

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
    return _answer(serving.serve(body, target, tokens, k or 0, chat=False,
                                 want_logprobs=k is not None,
                                 max_tokens=body.max_tokens
                                 or openai_serving.DEFAULT_COMPLETION_TOKENS))  # fmt: skip


@bp.post("/chat/completions")
def chat_completions() -> Any:
    body = parse(ChatCompletionRequest, json_body())
    return _answer(serving.chat(body, _target(body.model)))


def _target(model: str) -> openai_models.Target:
    try:
        with db.reading(services().db) as conn:
            return openai_models.resolve(conn, principal(), model)
    except ValidationError as exc:  # a session without sampler weights, a training checkpoint
        raise ParamError(exc.message, "model") from None


def _answer(answer: Any) -> Any:
    """A whole answer as JSON; a stream's Response as it is."""
    return answer if isinstance(answer, Response) else jsonify(answer)
