"""Completion notices over Redis pub/sub, so a long-polled future returns within milliseconds.

A worker (or a route that fails operations) publishes after its transaction commits. Each API
process holds ONE pattern subscription, in a `NoticeHub`, and hands notices to the requests
waiting on them, so no number of waiting clients takes more than one Redis connection. The
database is the truth and a notice only an optimisation: a waiter re-checks the database every
second or two, so it keeps working, by polling alone, while Redis is down. A request this
process admitted is known to be pending until its notice arrives, so its waiters skip the
database check they would otherwise start with; and where a notice carries the outcome itself
(`publish_done`'s `outcome`), they read nothing at all.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import redis

log = logging.getLogger(__name__)

T = TypeVar("T")

PREFIX = "treadle:done:"
PATTERN = PREFIX + "*"
FIRST_BACKOFF_SECONDS = 0.25
# Requests admitted here and not yet noticed that a hub remembers (the oldest are forgotten:
# their waiters check the database first, as for a request admitted elsewhere).
MAX_EXPECTED = 65_536
# The bare notice: "settled, read it from the database".
BARE = b"1"
# Outcomes larger than this go as a bare notice (a waiter reads the database). Every API
# process receives every notice, so only small ones ride along: a trivial operation's, whose
# round trip the read would lengthen most; a larger result took long enough to compute.
MAX_OUTCOME_BYTES = 4096
# Outcomes a hub holds for requests admitted here that no waiter has taken yet, in bytes (the
# oldest are dropped first: their waiters read the database). With several API processes the
# poll often reaches another one, so most such outcomes are never taken.
MAX_HELD_BYTES = 4 * 1024 * 1024

# Redis failures that mean "unreachable right now", as opposed to a bug.
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def channel(request_id: str) -> str:
    return f"{PREFIX}{request_id}"


def publish_done(client: redis.Redis, request_id: str, outcome: bytes | None = None) -> bool:
    """Announce that `request_id` is settled (call after commit), with its `outcome` as the
    database now holds it where given (see `NoticeHub.wait_until`; one larger than
    MAX_OUTCOME_BYTES is left out). A notice that cannot be sent (Redis is down) is only
    logged: waiters find the result in the database. Returns whether it was sent."""
    if outcome is None or len(outcome) > MAX_OUTCOME_BYTES:
        outcome = BARE
    try:
        client.publish(channel(request_id), outcome)
    except REDIS_DOWN as exc:
        log.warning("could not publish the completion of %s: %s", request_id, exc)
        return False
    return True


class NoticeHub:
    """One background thread and one pattern subscription per process, dispatching completion
    notices to the requests waiting on them (one `threading.Event` per waiting request).

    The thread reconnects with backoff while Redis is down; waiters meanwhile re-check the
    database every `poll_seconds`. `close()` stops the thread.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        recheck_seconds: float = 2.0,
        poll_seconds: float = 1.0,
        max_backoff_seconds: float = 5.0,
    ) -> None:
        self._client = client
        self._recheck_seconds = recheck_seconds
        self._poll_seconds = poll_seconds
        self._max_backoff_seconds = max_backoff_seconds
        self._waiters: dict[str, set[threading.Event]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._subscribed = threading.Event()  # set while a confirmed subscription is live
        self._thread: threading.Thread | None = None
        # How many subscriptions Redis has confirmed (the live one's number while _subscribed
        # is set), and the requests admitted here under the live one whose notice has not
        # arrived: request id -> (tenant id, subscription). Guarded by _lock.
        self._subscription = 0
        self._expected: OrderedDict[str, tuple[str, int]] = OrderedDict()
        # Outcomes that notices carried for requests admitted here, until a waiter of the same
        # tenant takes them: request id -> (tenant id, outcome); their bytes in all. Guarded
        # by _lock.
        self._held: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._held_bytes = 0

    @property
    def is_subscribed(self) -> bool:
        """Whether notices are arriving now: Redis confirmed the subscription, and it has not
        failed since (False while Redis is unreachable)."""
        return self._subscribed.is_set()

    @property
    def waiting(self) -> int:
        """How many requests are waiting for a notice."""
        with self._lock:
            return sum(len(events) for events in self._waiters.values())

    @property
    def held_bytes(self) -> int:
        """The bytes of outcomes held for requests admitted here that no waiter has taken."""
        with self._lock:
            return self._held_bytes

    def start(self) -> NoticeHub:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="treadle-notices", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def expect(self, request_id: str, tenant_id: str) -> None:
        """Note that this process is admitting `request_id` for `tenant_id`: call it before the
        admission commits, so before any worker can settle it. Until its notice arrives, a
        waiter of the same tenant skips the first `check` (the request is pending: nothing to
        read yet), provided the subscription confirmed now is still live. A request the
        transaction then does not commit is never waited on: its id reached no one."""
        with self._lock:
            if not self._subscribed.is_set():
                return
            self._expected[request_id] = (tenant_id, self._subscription)
            if len(self._expected) > MAX_EXPECTED:
                self._expected.popitem(last=False)

    def wait_until(
        self,
        request_id: str,
        check: Callable[[], T | None],
        timeout: float,
        *,
        tenant_id: str | None = None,
        from_outcome: Callable[[bytes], T] | None = None,
    ) -> T | None:
        """Return `check()` once it is not None, or None after `timeout` seconds.

        `check` reads the database; it runs first once registered for the notice (so a notice
        sent meanwhile is not missed), then on every notice and at least every `recheck_seconds`
        (every `poll_seconds` while no notice can arrive). The first check is skipped when
        `tenant_id` admitted the request here and its notice has not arrived (`expect`). When
        that notice carried the outcome, `from_outcome(outcome)` is returned instead of any
        check: the database is not read at all.
        """
        deadline = time.monotonic() + timeout
        event = threading.Event()
        self._register(request_id, event)
        try:
            # Registered first: a notice arriving from here on sets the event, which is not
            # cleared before the first wait.
            pending = tenant_id is not None and self._is_expected(request_id, tenant_id)
            while True:
                if from_outcome is not None and (held := self._take(request_id, tenant_id)):
                    return from_outcome(held)
                if pending:
                    pending = False
                else:
                    event.clear()  # before the check: a notice arriving after it wakes the wait
                    value = check()
                    if value is not None:
                        self._forget(request_id)  # done: a later wait reads it at once
                        return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                every = self._recheck_seconds if self.is_subscribed else self._poll_seconds
                event.wait(min(remaining, every))
        finally:
            self._unregister(request_id, event)

    # --- the subscription thread ------------------------------------------------------------

    def _run(self) -> None:
        backoff = FIRST_BACKOFF_SECONDS
        warned = False
        while not self._stopped.is_set():
            before = self._subscription
            try:
                self._listen()
            except REDIS_DOWN as exc:
                if not warned or self._subscription != before:
                    log.warning("completion notices paused (Redis: %s); waiters poll", exc)
                    warned = True
            except Exception:  # never let the one subscription die for good
                log.exception("the completion-notice subscription failed; reconnecting")
            # A subscription that worked starts the backoff over; failed attempts double it.
            if self._subscription != before:
                backoff = FIRST_BACKOFF_SECONDS
            else:
                backoff = min(backoff * 2, self._max_backoff_seconds)
            self._stopped.wait(backoff)

    def _listen(self) -> None:
        pubsub = self._client.pubsub()
        try:
            pubsub.psubscribe(PATTERN)
            while not self._stopped.is_set():
                message = pubsub.get_message(timeout=0.25)
                if message is None:
                    continue
                if message.get("type") == "pmessage":
                    self._dispatch(message["channel"], message["data"])
                elif message.get("type") == "psubscribe":  # confirmed: later notices come here
                    if not self._subscribed.is_set():
                        log.info("completion notices subscribed")
                    with self._lock:
                        self._subscription += 1
                        self._subscribed.set()
        finally:
            with self._lock:  # notices sent from now on may be missed: forget what was expected
                self._subscribed.clear()
                self._expected.clear()
            with contextlib.suppress(Exception):
                pubsub.close()

    def _dispatch(self, name: bytes | str, data: bytes | str = BARE) -> None:
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        if isinstance(data, str):
            data = data.encode()
        request_id = name.removeprefix(PREFIX)
        with self._lock:
            expected = self._expected.pop(request_id, None)
            if expected is not None and data != BARE:
                self._hold(request_id, expected[0], data)
            events = list(self._waiters.get(request_id, ()))
        for event in events:
            event.set()

    def _is_expected(self, request_id: str, tenant_id: str) -> bool:
        with self._lock:
            live = self._subscribed.is_set()
            return live and self._expected.get(request_id) == (tenant_id, self._subscription)

    def _hold(self, request_id: str, tenant_id: str, outcome: bytes) -> None:
        """Keep `outcome` for a waiter of `tenant_id` (under _lock), dropping the oldest held
        beyond MAX_HELD_BYTES."""
        self._unhold(request_id)  # one entry per request, counted once
        self._held[request_id] = (tenant_id, outcome)
        self._held_bytes += len(outcome)
        while self._held_bytes > MAX_HELD_BYTES:
            _, (_, dropped) = self._held.popitem(last=False)
            self._held_bytes -= len(dropped)

    def _take(self, request_id: str, tenant_id: str | None) -> bytes | None:
        """The outcome held for `request_id` if `tenant_id` admitted it, given up to the
        caller (a later wait reads the database)."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None or held[0] != tenant_id:
                return None
            return self._unhold(request_id)

    def _unhold(self, request_id: str) -> bytes | None:
        """Drop `request_id`'s held outcome (under _lock); it, or None."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        self._held_bytes -= len(held[1])
        return held[1]

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._expected.pop(request_id, None)
            self._unhold(request_id)

    def _register(self, request_id: str, event: threading.Event) -> None:
        with self._lock:
            self._waiters.setdefault(request_id, set()).add(event)

    def _unregister(self, request_id: str, event: threading.Event) -> None:
        with self._lock:
            events = self._waiters.get(request_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[request_id]
