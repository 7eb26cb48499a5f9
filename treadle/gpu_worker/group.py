"""Worker groups: one engine per rank of a `torch.distributed` process group, driven by rank 0.

Rank 0 is the worker the platform sees (it consumes the session queues, holds the leases and
settles); its engine is a `GroupEngine`, which sends every call that changes an adapter to the
other ranks (`broadcast_object_list` of the method and its arguments) before running it on its
own engine, so every rank's engine sees the same calls in the same order. The other ranks run
`follow`: receive a call, run it, until rank 0 closes the group or a collective times out. After
each call every rank checks that all ended the same way (the same error or none; after a call
that sets weights, the same weight hash): a rank that differs fails the group rather than train
on other weights than rank 0 reports.

Data parallel, exact: `forward_backward` splits a request into parts the same way at every world
size (`losses.microbatches`), each rank computes the parts `Group.assign` gives it (balanced by
tokens), and `Group.exchange` hands every rank every part's outputs and LoRA gradient; each rank
then adds the parts in their order, the sum one process makes, so adapters, optimizer states and
their hashes are the same bit for bit at every world size. What only reads (sampling, exports,
hashes, weights) runs on rank 0 alone, whose adapter is the whole adapter. Every collective has
the group's timeout: a rank that dies fails the others within it instead of hanging them.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["MIRRORED", "Group", "GroupEngine", "Part", "follow", "init_from_env", "leave"]

log = logging.getLogger(__name__)

# Engine methods every rank runs (they change what an adapter or snapshot holds); the rest run
# on rank 0 only.
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
# A rank's exit status when its group failed (a rank died, a collective timed out): its
# launcher ends the other ranks and the worker is started again.
GROUP_FAILED_EXIT = 75


@dataclass
class Part:
    """One part of a forward_backward: its data's outputs, its summed loss and its LoRA
    gradient (one tensor per adapter parameter, None where the parameter got none)."""

    outputs: list[dict[str, np.ndarray]]
    loss: float
    grads: list[torch.Tensor | None] | None


@dataclass
class CollectiveTime:
    """Time this rank spent in forward_backward's exchanges (waiting for the others included)."""

    seconds: float = 0.0
    calls: int = 0


@dataclass(frozen=True)
class Group:
    """This process's place in the group: its rank, the world size and the collectives'
    timeout."""

    rank: int
    world_size: int
    timeout_seconds: float
    exchanged: CollectiveTime = field(default_factory=CollectiveTime, compare=False)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def assign(self, tokens_P: Sequence[int]) -> list[int]:
        """The parts this rank computes: each part, largest first, goes to the rank with the
        fewest tokens so far (ties to the lowest rank). The same on every rank."""
        load = [0] * self.world_size
        owner = [0] * len(tokens_P)
        for part in sorted(range(len(tokens_P)), key=lambda p: (-tokens_P[p], p)):
            rank = min(range(self.world_size), key=lambda r: (load[r], r))
            owner[part] = rank
            load[rank] += tokens_P[part]
        return [p for p, r in enumerate(owner) if r == self.rank]

    def exchange(self, mine: dict[int, Part], count: int) -> list[Part]:
        """Every part, in order, on every rank: each rank's parts gathered to all."""
        local = {p: _portable(part) for p, part in mine.items()}
        gathered: list[Any] = [None] * self.world_size
        started = time.perf_counter()
        _collective("all_gather_object", lambda: dist.all_gather_object(gathered, local))
        self.exchanged.seconds += time.perf_counter() - started
        self.exchanged.calls += 1
        every: dict[int, Part] = {}
        for parts in gathered:
            every.update(parts)
        assert sorted(every) == list(range(count)), (sorted(every), count)
        return [every[p] for p in range(count)]


def _portable(part: Part) -> Part:
    """`part` with its gradients on the CPU, as gathered objects travel."""
    grads = None if part.grads is None else [None if g is None else g.cpu() for g in part.grads]
    return Part(part.outputs, part.loss, grads)


def init_from_env(timeout_seconds: float, device: str | None = None) -> Group:
    """Join the process group torchrun's environment describes (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT): NCCL on CUDA, gloo on the CPU, every collective bounded by `timeout_seconds`."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        backend="nccl" if on_cuda else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_seconds),
    )
    return Group(rank, world_size, timeout_seconds)


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

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.engine, name)
        if name not in MIRRORED:
            return attribute

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            interrupt: Callable[[], None] | None = kwargs.pop("interrupt", None)
            with self._sending:
                if interrupt is not None:
                    interrupt()
                _send(name, args, kwargs)
                result, error = _run(self.engine, name, args, kwargs)
            if error is not None:
                raise error
            return result

        return mirrored

    def ping(self) -> None:
        """While no call is in flight, show the other ranks the group is alive (they wait for
        the next call at most the group's timeout), and learn whether they are."""
        if self._sending.acquire(blocking=False):
            try:
                _send(_PING, (), {})
            finally:
                self._sending.release()

    def close(self) -> None:
        """Tell the other ranks to stop following."""
        with self._sending:
            _send(_CLOSE, (), {})


def _send(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    message: list[Any] = [(name, args, kwargs)]
    _collective("broadcast", lambda: dist.broadcast_object_list(message, src=0))


def _receive() -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    message: list[Any] = [None]
    _collective("broadcast", lambda: dist.broadcast_object_list(message, src=0))
    return message[0]  # type: ignore[no-any-return]


def _collective(what: str, run: Callable[[], Any]) -> Any:
    """Run a collective; if the group failed (a rank died, the timeout passed), end this rank
    at once: its operation stays pending in the log, and the next group rebuilds the session."""
    try:
        return run()
    except RuntimeError as exc:
        log.critical("the worker group failed in %s (%s); ending rank %d", what, exc, _rank())
        logging.shutdown()
        os._exit(GROUP_FAILED_EXIT)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else -1


def follow(engine: Any) -> None:
    """A rank other than 0: run each call rank 0 sends on `engine`, until it closes the group.
    A call's error is the same on every rank (the same inputs): it is logged and the rank goes
    on, as rank 0 reports it to the client."""
    while True:
        name, args, kwargs = _receive()
        if name == _CLOSE:
            return
        if name == _PING:
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
    every: list[Any] = [None] * dist.get_world_size()
    _collective("all_gather_object", lambda: dist.all_gather_object(every, outcome))
    if any(o != every[0] for o in every):
        log.critical(
            "the ranks of the worker group disagree after %s: %s; ending rank %d",
            name, every, _rank(),
        )  # fmt: skip
        logging.shutdown()
        os._exit(GROUP_FAILED_EXIT)
    return result, error


def leave() -> None:
    """Leave the process group (after rank 0 closed it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
