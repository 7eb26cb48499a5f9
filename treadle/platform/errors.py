"""Treadle's error hierarchy: one root, categories that also inherit the matching built-in.

Errors are raised by the core and translated only at the edges (API -> JSON with a status,
worker -> failed future with a category, SDK -> one exception class per status).
Imports nothing from the rest of Treadle.
"""

from __future__ import annotations

__all__ = [
    "AlreadyExistsError",
    "AuthenticationError",
    "ConflictError",
    "NotFoundError",
    "OperationCancelledError",
    "PermissionDeniedError",
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
