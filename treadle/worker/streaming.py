"""The worker's side of streamed samples (`treadle.platform.eventlog.progress`): which requests of a
running sample batch are streamed, the tokens each of their samples gained at every decoding
step published on the request's progress channel, and the client's cancellation read once per
step. Owns no decoding and settles nothing: the session host asks it which requests to cancel
and stops them through its usual interrupt. Imports platform and the engine's types; never api.

Cost: nothing for a batch without streamed requests beyond one round trip when requests join
(the EXISTS of their marks); while streamed requests run, one pipelined round trip per step
carries all their publishes and cancel checks. Redis being unreachable never fails a sample:
what could not be sent goes with the next step's messages (so a sample's messages still add up
to its tokens), or is lost at the end, where the settled result is the truth anyway.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Hashable, Sequence
from typing import Protocol

import redis

from treadle.engine import SampleResult
from treadle.platform.eventlog import progress
from treadle.platform.eventlog.notify import REDIS_DOWN

log = logging.getLogger(__name__)


class Drawing(Protocol):
    """What `Streams` reads of a running batch (`engine.SampleBatch`)."""

    def __contains__(self, key: Hashable) -> bool: ...

    def drawn(self, key: Hashable) -> tuple[list[list[int]], list[list[float]]]: ...


class Streams:
    """The streamed requests of one running sample batch and how many tokens of each of their
    samples were published. Used by the one thread that steps the batch."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._sent: dict[str, list[int]] = {}  # request id -> tokens published, per sample
        self._warned = False

    def __len__(self) -> int:
        return len(self._sent)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sent

    def join(self, requests: Sequence[tuple[str, int]]) -> list[str]:
        """Note which of `requests` ((request id, number of samples), joining the batch now)
        are streamed, in one round trip; returns those already cancelled by their client."""
        if not requests:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for request_id, _ in requests:
            pipe.exists(progress.stream_key(request_id))
            pipe.exists(progress.cancel_key(request_id))
        try:
            found = pipe.execute()
        except REDIS_DOWN as exc:
            self._warn(exc)
            return []  # unmarked: they run as ordinary samples
        cancelled = []
        for n, (request_id, num_samples) in enumerate(requests):
            streamed, cancel = found[2 * n], found[2 * n + 1]
            if streamed:  # a cancel mark alone means nothing: only streamed requests are read
                self._sent[request_id] = [0] * num_samples
                if cancel:
                    cancelled.append(request_id)
        return cancelled

    def after_step(
        self, batch: Drawing, finished: Sequence[tuple[Hashable, SampleResult | Exception]]
    ) -> list[str]:
        """Publish what each streamed request's samples gained (those that `finished` now: up to
        their final tokens) and read the cancel marks of those still running, in one round
        trip; returns the running streamed requests their clients cancelled."""
        if not self._sent:
            return []
        done = {str(key): out for key, out in finished}
        pipe = self._redis.pipeline(transaction=False)
        counts: dict[str, list[int]] = {}
        for request_id, sent in list(self._sent.items()):
            if request_id in done:
                out = done[request_id]
                del self._sent[request_id]  # nothing more will come for it
                if not isinstance(out, SampleResult):
                    continue  # failed or cancelled: its error is in the settled row
                tokens_N = [s.tokens for s in out.sequences]
                logprobs_N = [s.logprobs for s in out.sequences]
            elif request_id in batch:
                tokens_N, logprobs_N = batch.drawn(request_id)
            else:
                continue
            now = list(sent)
            for i, (tokens, logprobs) in enumerate(zip(tokens_N, logprobs_N, strict=True)):
                if len(tokens) > sent[i]:
                    message = {
                        "sample": i,
                        "tokens": tokens[sent[i] :],
                        "logprobs": logprobs[sent[i] :],
                    }
                    pipe.publish(progress.channel(request_id), json.dumps(message))
                    now[i] = len(tokens)
            counts[request_id] = now
        running = list(self._sent)
        for request_id in running:
            pipe.exists(progress.cancel_key(request_id))
        try:
            replies = pipe.execute()
        except REDIS_DOWN as exc:
            self._warn(exc)
            return []  # unsent tokens go with the next step's messages
        for request_id, now in counts.items():
            if request_id in self._sent:
                self._sent[request_id] = now
        checks = replies[len(replies) - len(running) :] if running else []
        return [r for r, cancel in zip(running, checks, strict=True) if cancel]

    def _warn(self, exc: Exception) -> None:
        if not self._warned:  # once per batch: a Redis outage must not flood the log
            log.warning("sample progress not published (Redis: %s); results are unaffected", exc)
            self._warned = True
