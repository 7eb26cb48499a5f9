"""How rank 0 drives a worker group: `GroupEngine` on rank 0, `follow` on the others.

Rank 0 is the worker the platform sees (it consumes the session queues, holds the leases and
settles); its engine is a `GroupEngine`, which sends every call that changes an adapter to the
other ranks (a broadcast of the method and its arguments) before running it on its own engine,
so every rank's engine sees the same calls in the same order. The other ranks run `follow`:
receive a call, run it, until rank 0 closes the group or a collective times out. After each call
every rank checks that all ended the same way (the same error or none; after a call that sets
weights, the same weight hash): a rank that differs fails the group rather than train on other
weights than rank 0 reports. Sampling runs on the whole group (`group_batches`); what only reads
an adapter (exports, hashes, weights) runs on rank 0 alone, whose adapter is the whole adapter.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from treadle.engine.distributed import decoding as group_batches
from treadle.engine.distributed.group import Group, broadcast, fail, gather
from treadle.engine.memory.capacity import device_memory_in_use
from treadle.engine.sampling.decode import SampleRequest

__all__ = ["MIRRORED", "GroupEngine", "follow"]

log = logging.getLogger(__name__)

# Engine methods every rank runs (they change what an adapter or snapshot holds, or run the base
# model); the rest run on rank 0 only.
MIRRORED = frozenset(
    {
        "create_adapter",
        "drop_adapter",
        "set_adapter_weights",
        "forward_backward",
        "optim_step",
        "snapshot",
        "drop_snapshot",
        "import_adapter",
        "load_snapshot",
    }
)
# Mirrored calls after which every rank's adapter weights are compared (by hash).
_SETS_WEIGHTS = frozenset({"create_adapter", "set_adapter_weights", "optim_step", "import_adapter"})
_CLOSE = "__close__"
_PING = "__ping__"


class GroupEngine:
    """Rank 0's engine: the `Engine` interface, each mirrored call sent to the other ranks
    first. `interrupt` callbacks run on rank 0, once, before a call is sent (a call the group
    has started runs to its end on every rank)."""

    def __init__(self, engine: Any, group: Group) -> None:
        assert group.is_leader
        self.engine = engine
        self.group = group
        # One call in flight across the group: a ping never lands inside a call's collectives.
        self._sending = threading.Lock()
        # Each rank's device memory in use by kind (`capacity.device_memory_in_use`), as of the
        # last ping: the worker's metrics show every rank's.
        self.rank_memory: dict[int, dict[str, float]] = {}

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.engine, name)
        if name not in MIRRORED:
            return attribute

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            interrupt: Callable[[], None] | None = kwargs.pop("interrupt", None)
            with self._sending:
                if interrupt is not None:
                    interrupt()
                broadcast((name, args, kwargs))
                result, error = _run(self.engine, name, args, kwargs)
            if error is not None:
                raise error
            return result

        return mirrored

    # Sampling: the engine's own loops, each batch a `LeaderBatch` the whole group decodes.

    def open_batch(self, base_model: str) -> group_batches.LeaderBatch:
        return group_batches.LeaderBatch(self, base_model)

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.engine).sample(self, *args, **kwargs)

    def sample_batch(
        self, requests: Sequence[SampleRequest], *, interrupt: Callable[[], None] | None = None
    ) -> list[Any]:
        return type(self.engine).sample_batch(self, requests, interrupt=interrupt)  # type: ignore[no-any-return]

    def call_all(self, name: str, args: tuple[Any, ...], local: Callable[[], Any]) -> list[Any]:
        """Send `name(*args)` to the other ranks, run `local` here, and gather every rank's
        answer (rank 0's is what `local` returned)."""
        with self._sending:
            broadcast((name, args, {}))
            return gather(local())

    def ping(self) -> None:
        """While no call is in flight, show the other ranks the group is alive (they wait for
        the next call at most the group's timeout), learn whether they are, and read each
        one's device memory."""
        if self._sending.acquire(blocking=False):
            try:
                broadcast((_PING, (), {}))
                every = gather(device_memory_in_use(self.engine.device))
                self.rank_memory = dict(enumerate(every))
            finally:
                self._sending.release()

    def close(self) -> None:
        """Tell the other ranks to stop following."""
        with self._sending:
            broadcast((_CLOSE, (), {}))


def follow(engine: Any, group: Group) -> None:
    """A rank other than 0: run each call rank 0 sends on `engine`, until it closes the group.
    A call's error is the same on every rank (the same inputs): it is logged and the rank goes
    on, as rank 0 reports it to the client."""
    batches = group_batches.FollowerBatches(engine, group)
    while True:
        name, args, kwargs = broadcast(None)
        if name == _CLOSE:
            return
        if name == _PING:
            gather(device_memory_in_use(engine.device))
            continue
        if name in group_batches.CALLS:
            batches.run(name, args)
            continue
        _, error = _run(engine, name, args, kwargs)
        if error is not None:  # the same as rank 0's (`_run` checked), which reports it
            log.info("rank call %s failed as on rank 0: %s", name, error)


def _run(
    engine: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Exception | None]:
    """Run a mirrored call on this rank's engine, then check with every rank that it ended the
    same way: the same error or none, and for a call that sets an adapter's weights the same
    weight hash. A rank that differs (a failure of its own, weights that drifted) would go on
    training on other weights than rank 0 reports: the group fails instead, and the next one
    rebuilds its sessions from the log."""
    result: Any = None
    error: Exception | None = None
    try:
        result = getattr(engine, name)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001  # compared below, then raised on rank 0
        error = exc
    weights = None
    if error is None and name in _SETS_WEIGHTS:
        weights = engine.weight_hash(args[0] if args else kwargs["adapter_id"])
    outcome = (type(error).__name__ if error is not None else None, weights)
    every = gather(outcome)
    if any(o != every[0] for o in every):
        fail(f"the ranks of the worker group disagree after {name}: {every}")
    return result, error
