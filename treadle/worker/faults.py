"""Fault injection for the fault tests, off unless the worker runs with TREADLE_DEBUG_FAULTS=1.

A test arms a pause for one session in Redis (`arm_pause`); the next operation of that type the
session's worker executes then holds still after its effect on the engine and before its
settlement, and announces it (`treadle:debug:paused:<session>` = seq_id), so the test can kill the
worker, PostgreSQL or Redis at exactly that point; it resumes after its time, or as soon as the
test deletes that key (`release`). One-shot: the pause is consumed when it fires, so the
operation's re-execution by the next holder runs straight through. A pause armed for
`IN_PASSES` holds a forward_backward before its first pass instead, inside the engine's training
call. A settlement that fails is announced too (`treadle:debug:settle-failed:<session>` =
seq_id).
Imports platform only; never api.
"""

from __future__ import annotations

import logging
import time

import redis

log = logging.getLogger(__name__)

# The pause type that holds a forward_backward before its first pass (`arm_pause`).
IN_PASSES = "forward_backward_passes"


def _pause_key(session_id: str) -> str:
    return f"treadle:debug:pause:{session_id}"


def paused_key(session_id: str) -> str:
    return f"treadle:debug:paused:{session_id}"


def arm_pause(client: redis.Redis, session_id: str, op_type: str, seconds: float) -> None:
    """Make the session's next `op_type` pause `seconds` before its settlement."""
    client.set(_pause_key(session_id), f"{op_type}:{seconds}")
    client.delete(paused_key(session_id))


def settle_failed_key(session_id: str) -> str:
    return f"treadle:debug:settle-failed:{session_id}"


def note_settle_failure(client: redis.Redis, session_id: str, seq_id: int) -> None:
    """Tell the test that a settlement of the session failed (its effect was discarded)."""
    try:
        client.set(settle_failed_key(session_id), str(seq_id))
    except redis.RedisError:
        log.warning("debug: could not record the failed settlement of %s", session_id)


def release(client: redis.Redis, session_id: str) -> None:
    """End a pause now."""
    client.delete(paused_key(session_id))


def maybe_pause(
    client: redis.Redis, session_id: str, op_type: str, seq_id: int, closing: object
) -> None:
    """Called by the host between an operation's effect and its settlement."""
    raw = client.get(_pause_key(session_id))
    if raw is None:
        return
    armed = raw.decode() if isinstance(raw, bytes) else str(raw)
    armed_type, seconds = armed.split(":")
    if armed_type != op_type or not client.delete(_pause_key(session_id)):
        return
    log.warning("debug: %s seq %d of %s paused %s s before settling", op_type, seq_id,
                session_id, seconds)  # fmt: skip
    client.set(paused_key(session_id), str(seq_id))
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline and not getattr(closing, "is_set", lambda: False)():
        time.sleep(0.05)
        try:
            if not client.exists(paused_key(session_id)):
                return  # released by the test
        except redis.RedisError:
            pass  # the test killed Redis: pause on until the time is up
