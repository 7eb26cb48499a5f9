"""The two wire protocols of SageMaker's API at Treadle's edge: answers and errors as botocore
parses them, the signed request's caller, its body and the per-process caches the surface keeps.

- json 1.1 (`POST /`, the control plane, Hub and registry): errors are HTTP 400 (a client's
  fault) or 5xx with the body `{"__type": code, "message": ...}`.
- rest-json (`/v1/training-sessions/...`, the runtime): errors carry the status the service
  model declares (400, 403, 404, 409, 429, 500, 503), the `x-amzn-ErrorType` header and the same
  body.
Every platform error maps to the code SageMaker's clients know (`aws_error`); a refused training
submit still has its sequence number remembered, so later ones run (`errors.remember_refusal`).
Imports platform only; never torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from datetime import datetime
from typing import Any

from flask import Response, g, request
from werkzeug.exceptions import HTTPException

from treadle.api import body as bodies
from treadle.api import errors as api_errors
from treadle.api.context import services
from treadle.platform.errors import (
    AlreadyExistsError,
    AuthenticationError,
    LimitError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    StateConflictError,
    TreadleError,
    UnavailableError,
    ValidationError,
)

log = logging.getLogger(__name__)

JSON_11 = "application/x-amz-json-1.1"
REST_JSON = "application/json"
# The SageMaker SDK's forwardBackward chunks hold up to about 1M tokens and values.
MAX_BODY_VALUES = 2**21


class AwsError(TreadleError):
    """A refusal answered with an AWS error code of its own (`aws_code`)."""

    category = "user"

    def __init__(self, aws_code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.aws_code = aws_code
        self.status = status
        self.code = aws_code

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.aws_code, self.message, self.status))


def is_runtime() -> bool:
    """Whether this request is the runtime's (rest-json) rather than the control plane's."""
    return request.path != "/"


def aws_error(exc: TreadleError, *, runtime: bool) -> tuple[str, int]:
    """(AWS error code, HTTP status) of a platform error, for the request's protocol."""
    if isinstance(exc, AwsError):
        return exc.aws_code, exc.status if runtime or exc.status >= 500 else 400
    auth_code = getattr(exc, "aws_code", None)  # the signature check names its own code
    if isinstance(exc, AuthenticationError | PermissionDeniedError):
        code = auth_code or (
            "AccessDeniedException"
            if isinstance(exc, PermissionDeniedError)
            else "UnrecognizedClientException"
        )
        return code, 403 if runtime else 400
    if isinstance(exc, NotFoundError):
        return ("ResourceNotFoundException", 404) if runtime else ("ResourceNotFound", 400)
    if isinstance(exc, AlreadyExistsError):
        return ("ConflictException", 409) if runtime else ("ResourceInUse", 400)
    if isinstance(exc, StateConflictError):
        return ("ConflictException", 409) if runtime else ("ConflictException", 400)
    if isinstance(exc, UnavailableError):
        return ("ServiceUnavailableException" if runtime else "ServiceUnavailable"), 503
    if isinstance(exc, QuotaExceededError):  # money: not to be retried
        return "ServiceQuotaExceededException", 402
    if isinstance(exc, LimitError):
        if exc.details.get("limit") == "max_sessions" and not runtime:
            return "ResourceLimitExceeded", 400
        if exc.status == 429:
            return "ThrottlingException", 429
        return "ValidationException", 400
    if exc.status < 500:
        return "ValidationException", 400
    return ("InternalServerException", 500) if runtime else ("InternalFailure", 500)


def error_response(code: str, message: str, status: int, *, runtime: bool) -> Response:
    response = Response(
        json.dumps({"__type": code, "message": message}),
        status=status,
        mimetype=REST_JSON if runtime else JSON_11,
    )
    if runtime:
        response.headers["x-amzn-ErrorType"] = code
    return response


def handle_error(exc: Exception) -> Response:
    """Every refusal and failure of this surface, in the request's protocol's error shape."""
    runtime = is_runtime()
    svc = services()
    if isinstance(exc, HTTPException):
        status = exc.code or 400
        message = exc.description or exc.name
        if status == 413:
            message = (
                f"the request body is larger than this server's limit of "
                f"{svc.config.sagemaker_max_body_bytes} bytes "
                "(TREADLE_SAGEMAKER_MAX_BODY_BYTES); send smaller requests"
            )
        elif status == 404:
            message = f"no route {request.method} {request.path}"
        code = "ResourceNotFoundException" if status == 404 else "ValidationException"
        api_errors.remember_refusal(svc, status)
        return error_response(code, message, status, runtime=runtime)
    if not isinstance(exc, TreadleError):
        down = api_errors.dependency_failure(exc)
        if down is None:
            log.exception("unhandled error on %s %s", request.method, request.path)
            exc = TreadleError("internal server error")
        else:
            log.warning("%s %s: %s (%s)", request.method, request.path, down.message, exc)
            exc = down
    code, status = aws_error(exc, runtime=runtime)
    api_errors.remember_refusal(svc, status)
    response = error_response(code, exc.message, status, runtime=runtime)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


def read_json() -> Any:
    """The request's JSON body ({} when empty): bounded like every body of Treadle's, and
    larger bodies (forwardBackward chunks) allowed on the runtime."""
    raw = request.get_data(cache=True)
    if not raw.strip():
        return {}
    value = bodies.loads(raw, max_values=MAX_BODY_VALUES)
    bodies.reject_nul(value)
    if not isinstance(value, dict):
        raise ValidationError("the request body must be a JSON object")
    return value


def answer(data: dict[str, Any], *, runtime: bool | None = None) -> Response:
    """A successful answer: `data` as JSON, members that are None left out, datetimes as epoch
    seconds and non-finite floats as the strings botocore reads back. A runtime answer (a
    result: long lists of numbers, no None member) is encoded as it is unless it holds a
    non-finite float; only then is it walked."""
    runtime = is_runtime() if runtime is None else runtime
    text = None
    if runtime:
        with contextlib.suppress(ValueError):  # a non-finite float, e.g. a NaN loss
            text = json.dumps(data, separators=(",", ":"), allow_nan=False, default=_time)
    if text is None:
        text = json.dumps(_wire(data), separators=(",", ":"), allow_nan=False, default=_time)
    return Response(text, status=200, mimetype=REST_JSON if runtime else JSON_11)


def _time(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.timestamp()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _wire(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _wire(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_wire(v) for v in value]
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def region() -> str:
    """The region the caller's signature named (ARNs echo it)."""
    return str(g.aws_region)
