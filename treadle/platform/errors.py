"""Treadle's error hierarchy: one root, categories that also inherit the matching built-in.

Errors are raised by the core and translated only at the edges (API -> JSON with a status,
worker -> failed future with a category, SDK -> one exception class per status).
Imports nothing from the rest of Treadle.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AlreadyExistsError",
    "AuthenticationError",
    "ConflictError",
    "GoneError",
    "InactiveSessionError",
    "NotFoundError",
    "OperationCancelledError",
    "LimitError",
    "PermissionDeniedError",
    "QuotaExceededError",
    "RateLimitedError",
    "RequestTooLargeError",
    "StateConflictError",
    "TimeLimitExceededError",
    "TreadleError",
    "UnavailableError",
    "ValidationError",
]


class TreadleError(Exception):
    """Root of every error Treadle raises on purpose."""

    status = 500
    code = "internal"
    category = "server"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (self.message,))


class ValidationError(TreadleError, ValueError):
    """The request is malformed; the message says what is wrong and how to fix it."""

    status = 400
    code = "invalid_request"
    category = "user"


class InactiveSessionError(ValidationError):
    """An operation for a session that no longer runs (stopped, expired, failed, diverged)."""


class AuthenticationError(TreadleError, PermissionError):
    status = 401
    code = "unauthenticated"
    category = "user"


class PermissionDeniedError(TreadleError, PermissionError):
    status = 403
    code = "permission_denied"
    category = "user"


class NotFoundError(TreadleError, LookupError):
    """The thing does not exist, or belongs to another tenant (indistinguishable on purpose)."""

    status = 404
    code = "not_found"
    category = "user"


class GoneError(TreadleError):
    """The thing existed but is over (a finished or expired client session); make a new one."""

    status = 410
    code = "gone"
    category = "user"


class ConflictError(TreadleError):
    """The request contradicts one already accepted (e.g. a different payload under a used seq_id)."""

    status = 400
    code = "conflict"
    category = "user"


class StateConflictError(TreadleError):
    """The request cannot be applied to the thing's current state (HTTP 409), e.g. revoking the
    last operator key or disabling the operator's own tenant. Unlike `ConflictError` (a 400 for a
    request that contradicts an earlier one), retrying after the state changed can succeed."""

    status = 409
    code = "state_conflict"
    category = "user"


class AlreadyExistsError(StateConflictError):
    """The thing to create exists already (HTTP 409); nothing was created or changed."""

    code = "already_exists"


class UnavailableError(TreadleError):
    """A dependency (database, broker, worker) cannot serve the request right now; retry later.

    `retry_after` is how many seconds the client should wait before it retries (the API sends it
    as the answer's Retry-After header).
    """

    status = 503
    code = "unavailable"
    category = "server"

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[type, tuple[str, int]]:  # type: ignore[override]
        return (type(self), (self.message, self.retry_after))


class OperationCancelledError(TreadleError):
    """The operation was stopped while it ran (its session was stopped)."""

    status = 409
    code = "cancelled"
    category = "user"


class TimeLimitExceededError(TreadleError, TimeoutError):
    """The operation ran longer than the platform's execution time limit and was stopped."""

    status = 408
    code = "time_limit_exceeded"
    category = "user"


class LimitError(TreadleError):
    """A request refused by a quota. `details` names the limit, its value, the current use and
    when it resets (the API puts them in the error body beside code and message)."""

    def __init__(
        self,
        message: str,
        *,
        limit: str,
        value: float,
        current: float,
        resets_at: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.details = {"limit": limit, "value": value, "current": current, "resets_at": resets_at}
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        details = self.details
        return (
            _limit_error,
            (type(self), self.message, details["limit"], details["value"], details["current"],
             details["resets_at"], self.retry_after),
        )  # fmt: skip


def _limit_error(
    cls: type[LimitError],
    message: str,
    limit: str,
    value: float,
    current: float,
    resets_at: str | None,
    retry_after: int | None,
) -> LimitError:
    return cls(
        message,
        limit=limit,
        value=value,
        current=current,
        resets_at=resets_at,
        retry_after=retry_after,
    )


class QuotaExceededError(LimitError):
    """A spend or token budget would be exceeded (HTTP 402)."""

    status = 402
    code = "quota_exceeded"
    category = "user"


class RateLimitedError(LimitError):
    """Too many requests or sessions right now (HTTP 429); retry after `retry_after` seconds."""

    status = 429
    code = "rate_limited"
    category = "user"


class RequestTooLargeError(LimitError):
    """One request asks for more tokens than the tenant's largest-request quota (HTTP 413)."""

    status = 413
    code = "request_too_large"
    category = "user"
