"""Incremental sample progress and prompt cancellation of a streamed sample, over Redis.

The contract between the API (which streams a sample to its client) and the worker (which
decodes it):

- The API marks a request as streamed with `want_progress` BEFORE the worker can admit it. Its
  request_id is only known once `operations.admit` has run, so mark it inside the admission
  transaction: `commands.submit(..., on_admitted=lambda a: want_progress(redis, a.request_id))`
  runs before the commit, so no worker can see the operation unmarked.
- The worker checks the mark once when the request joins a batch (one round trip for all that
  join). For a marked request it publishes, after each decoding step, the tokens each of its
  samples gained on `channel(request_id)` as JSON {"sample": i, "tokens": [...],
  "logprobs": [...]} (one message per sample that gained tokens; logprobs of the sampled
  tokens), then settles the operation and sends its done notice (`notify.publish_done`).
  Nothing is published for an unmarked request.
- `follow` subscribes to the progress channel and the done notice in one pubsub and yields each
  message until the done notice. Enter it before any worker can run the request, so nothing is
  lost: in the same `on_admitted` (set `request_id` on a `Follow` made beforehand, then enter
  it), or before `submit` when the request_id is known.
- `cancel_streamed` (the client went away) sets a key the worker reads once per decoding step
  for its running streamed requests: the request's rows leave the batch at its next step and it
  settles failed, code "cancelled", message `CANCELLED_MESSAGE`; the batch's other rows go on.

What a consumer must do: the final result (the operations row, read after `follow` returns) is
the truth. The published tokens of a sample, concatenated, equal its final tokens exactly when
every publish reached Redis; a stop sequence is included in both (the worker does not trim), so a
consumer that must not show it trims the text itself at the end, and one that missed messages
(Redis hiccup, subscribed late) sends what the final result has beyond what it streamed.
A failed operation publishes no more progress; its error is in the row.

Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import redis

from treadle.platform.errors import TreadleError
from treadle.platform.eventlog import notify

__all__ = [
    "CANCELLED_MESSAGE",
    "PROGRESS_TTL_SECONDS",
    "Follow",
    "ProgressTimeoutError",
    "cancel_key",
    "cancel_streamed",
    "channel",
    "follow",
    "stream_key",
    "want_progress",
]

# How long a streamed mark (and a cancel mark) lives: longer than any sample may run.
PROGRESS_TTL_SECONDS = 3600
CANCELLED_MESSAGE = "cancelled: the client disconnected"
PREFIX = "treadle:progress:"
# How often `follow` asks `is_done` while no message comes (a lost done notice never hangs it).
RECHECK_SECONDS = 2.0


class ProgressTimeoutError(TreadleError, TimeoutError):
    """The streamed sample did not finish within the caller's time limit (an HTTP 504)."""

    status = 504
    code = "timeout"
    category = "server"


def channel(request_id: str) -> str:
    return f"{PREFIX}{request_id}"


def stream_key(request_id: str) -> str:
    return f"treadle:stream:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"treadle:cancel:{request_id}"


def want_progress(client: redis.Redis, request_id: str) -> None:
    """Mark `request_id` as streamed: the worker publishes its tokens as they are decoded."""
    client.set(stream_key(request_id), b"1", ex=PROGRESS_TTL_SECONDS)


def cancel_streamed(client: redis.Redis, request_id: str) -> None:
    """Ask the worker to stop the streamed request `request_id` at its next decoding step; it
    settles failed with code "cancelled" and `CANCELLED_MESSAGE`. A request not streamed, not
    yet running or already settled is unaffected (fail it in the database to cover those)."""
    client.set(cancel_key(request_id), b"1", ex=PROGRESS_TTL_SECONDS)


class Follow:
    """A streamed request's progress messages, in order, until its done notice.

    `with Follow(...) as f:` subscribes (do it before submitting the request), then
    `for message in f:` yields each {"sample", "tokens", "logprobs"} dict and stops after the
    done notice, or once `is_done()` (a database read, asked whenever no message came for
    `RECHECK_SECONDS`) says so; past `timeout_seconds` from entering it raises
    ProgressTimeoutError. Redis errors propagate (redis.exceptions.ConnectionError).
    """

    def __init__(
        self,
        client: redis.Redis,
        request_id: str,
        *,
        timeout_seconds: float,
        is_done: Callable[[], bool] | None = None,
    ) -> None:
        self.request_id = request_id
        self._client = client
        self._timeout = timeout_seconds
        self._is_done = is_done
        self._pubsub: Any = None
        self._deadline = 0.0

    def __enter__(self) -> Follow:
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(channel(self.request_id), notify.channel(self.request_id))
        except BaseException:
            pubsub.close()
            raise
        self._pubsub = pubsub
        self._deadline = time.monotonic() + self._timeout
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):  # closing a broken connection: nothing to keep
                self._pubsub.close()
            self._pubsub = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._pubsub is None:
            raise RuntimeError("enter the Follow (`with follow(...) as f:`) before iterating it")
        progress = channel(self.request_id).encode()
        heard = time.monotonic()  # when a message last came
        while True:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise ProgressTimeoutError(
                    f"request {self.request_id} did not finish within {self._timeout:g} s; "
                    "its result stays readable with retrieve_future"
                )
            message = self._pubsub.get_message(timeout=min(remaining, RECHECK_SECONDS))
            if message is None:
                # quiet for a while: a done notice lost to a Redis hiccup must not hang this
                if self._is_done is not None and time.monotonic() - heard >= RECHECK_SECONDS:
                    heard = time.monotonic()
                    if self._is_done():
                        return
                continue
            if message.get("type") != "message":
                continue
            name = message["channel"]
            if (name.encode() if isinstance(name, str) else name) != progress:
                return  # the done notice: the worker published all progress before it
            heard = time.monotonic()
            yield json.loads(message["data"])


def follow(
    client: redis.Redis,
    request_id: str,
    *,
    timeout_seconds: float,
    is_done: Callable[[], bool] | None = None,
) -> Follow:
    """A `Follow` of `request_id` (enter it before submitting the request)."""
    return Follow(client, request_id, timeout_seconds=timeout_seconds, is_done=is_done)
