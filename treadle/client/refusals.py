"""Budget refusals as the SDK raises them: the tinker SDK raises a 402 as `tinker.BillingError`
whose message is "Error code: 402 - {...}"; Treadle's clients raise `QuotaExceededError`
instead, whose message is the platform's (which limit, its value, what is used, when it
resets). `translated` wraps a tinker future so that its result raises it; `refusals_translated`
does the same around a blocking call. Imports nothing from the server side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

import httpx
import tinker
from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture

T = TypeVar("T")


class QuotaExceededError(tinker.BillingError):
    """A request refused because a budget is spent (HTTP 402): the tenant's monthly budget
    (`monthly_usd`, `monthly_tokens`) or the session's spend cap (`max_cost_usd`).

    Its message is the platform's: what the request needs, what is used and how to go on,
    then the limit, its value, the use and when it resets. `limit`, `value`, `current` and
    `resets_at` (ISO 8601; None for a cap that never resets) say the same as attributes.
    A `tinker.BillingError`, so code written for the tinker SDK catches it too.

    Example:
        try: tc.forward_backward(datums, "cross_entropy").result()
        except treadle.QuotaExceededError as exc: print(exc.limit, exc.resets_at)
    """

    def __init__(self, message: str, response: httpx.Response, body: object | None) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        self.code: str | None = error.get("code")
        self.limit: str | None = error.get("limit")
        self.value: float | None = error.get("value")
        self.current: float | None = error.get("current")
        self.resets_at: str | None = error.get("resets_at")
        described = _describe(error) if isinstance(error.get("message"), str) else message
        super().__init__(described, response=response, body=body)

    @classmethod
    def of(cls, exc: tinker.BillingError) -> QuotaExceededError:
        """The Treadle error for the tinker SDK's 402 `exc`."""
        return cls(exc.message, exc.response, exc.body)


def _describe(error: dict[str, Any]) -> str:
    message = str(error["message"])
    limit = error.get("limit")
    if not limit:
        return message
    unit = "$" if str(limit).endswith("usd") else ""
    value, current = _amount(error.get("value")), _amount(error.get("current"))
    resets = error.get("resets_at")
    when = f"resets at {resets}" if resets else "does not reset"
    return f"{message} [{limit}: limit {unit}{value}, used {unit}{current}, {when}]"


def _amount(number: Any) -> str:
    if isinstance(number, float):
        return str(int(number)) if number.is_integer() else f"{number:.6f}".rstrip("0").rstrip(".")
    return str(number)


def translate(exc: BaseException) -> BaseException:
    """`exc`, or the QuotaExceededError it stands for (its cause the tinker SDK's error)."""
    if isinstance(exc, tinker.BillingError) and not isinstance(exc, QuotaExceededError):
        refusal = QuotaExceededError.of(exc)
        refusal.__cause__ = exc
        return refusal
    return exc


@contextlib.contextmanager
def refusals_translated() -> Iterator[None]:
    """Raise a tinker.BillingError raised in the block as a QuotaExceededError."""
    try:
        yield
    except tinker.BillingError as exc:
        raise translate(exc) from exc


def translated(inner: APIFuture[T]) -> APIFuture[T]:
    """A future with `inner`'s result, whose 402 raises QuotaExceededError. Cancelling it
    cancels `inner` (the operation), as cancelling a tinker future does."""
    source = inner.future()
    outer: Future[T] = Future()

    def settle(done: Future[T]) -> None:
        if done.cancelled():
            outer.cancel()
            return
        exc = done.exception()
        try:
            if exc is None:
                outer.set_result(done.result())
            else:
                outer.set_exception(translate(exc))
        except InvalidStateError:  # the caller cancelled it first
            pass

    def cancel_source(done: Future[T]) -> None:
        if done.cancelled():
            source.cancel()

    outer.add_done_callback(cancel_source)
    source.add_done_callback(settle)
    return AwaitableConcurrentFuture(outer)
