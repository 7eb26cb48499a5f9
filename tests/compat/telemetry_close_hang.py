"""How often the tinker SDK's telemetry task outlives its cancel, on the running Python.

`ServiceClient.close()` asks the SDK's `Telemetry` for a flush, cancels its flush task and waits
for it. On Python 3.11, `asyncio.wait_for` can drop that cancel (docs/tinker-compatibility.md,
"Known SDK faults"); the task then never ends and `close()` never returns. This drives the SDK's
own `Telemetry` class with a sender that answers after a random delay, closing each object while
a flush is under way, many objects at once on one event loop, and counts the closes that have
not returned after `--wait` seconds (the SDK's drain gives up after 30):

    python -m tests.compat.telemetry_close_hang --objects 400 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

from tinker.lib.telemetry import Telemetry


class _Sender:
    """The SDK's telemetry resource, answering after up to 30 ms."""

    async def send(self, request: Any, timeout: float) -> None:
        await asyncio.sleep(random.uniform(0, 0.03))


class _Client:
    telemetry = _Sender()


class _Provider:
    """What `Telemetry` needs of its holder: the loop, and a client per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @contextlib.contextmanager
    def aclient(self, pool_type: Any) -> Iterator[_Client]:
        yield _Client()


async def _closes_in_time(wait: float) -> bool:
    """One object: an event, a flush under way, another event, then `close()`."""
    telemetry = Telemetry(_Provider(asyncio.get_running_loop()), session_id="s")
    await asyncio.sleep(0.01)
    telemetry.log("first")
    telemetry._trigger_flush()
    await asyncio.sleep(random.uniform(0, 0.03))
    telemetry.log("second")
    closing = asyncio.ensure_future(telemetry.close())
    try:
        await asyncio.wait_for(asyncio.shield(closing), wait)
        return True
    except TimeoutError:
        return False


async def _main(objects: int, rounds: int, wait: float) -> None:
    hung = 0
    for index in range(rounds):
        closed = await asyncio.gather(*(_closes_in_time(wait) for _ in range(objects)))
        hung_now = closed.count(False)
        hung += hung_now
        print(f"round {index + 1}: {hung_now} of {objects} closes hung", flush=True)
    print(f"Python {sys.version.split()[0]}: {hung} of {objects * rounds} closes hung")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=400, help="objects closed at once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait", type=float, default=40.0, help="seconds before a close hung")
    args = parser.parse_args()
    asyncio.run(_main(args.objects, args.rounds, args.wait))


if __name__ == "__main__":
    main()
