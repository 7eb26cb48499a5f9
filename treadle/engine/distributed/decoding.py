"""Sampling on a worker group: continuous sample batches whose steps every rank takes together.

Rank 0's `LeaderBatch` stands where one process has the engine's `SampleBatch` (`add`, `step`,
`drawn`, `len`, `in`) and sends each add and step to the other ranks, whose `FollowerBatches`
run them on batches of their own engine. Each rank's share is a `_Share`.

- Replicated layout: each request is decoded by one rank, the one with the fewest rows decoding
  when it joins. Its rows stay together, so it draws from its one seeded generator as it would
  alone: the same seed gives the same tokens at every world size. After each add and step, the
  requests each rank finished and the tokens its live ones drew are gathered to rank 0, which
  settles them and streams them (`drawn`).
- Sharded layout: a forward pass gathers each layer's weights from every rank, so every rank
  decodes every request in lockstep, and rank 0 reports its own results.

A request's own interrupt (its client's cancellation, its time limit) runs on rank 0 before a
step is sent: the step names the requests that stop, and every rank stops them at that step. A
rank whose share fails fails the whole batch (every rank drops it and rank 0 raises), as an
engine failure fails every sample of one process's batch.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from treadle.engine.distributed.group import Group, gather
from treadle.engine.sampling.decode import Finished, SampleRequest

__all__ = ["CALLS", "FollowerBatches", "LeaderBatch", "Stopped"]

log = logging.getLogger(__name__)

_ADD, _STEP = "__batch_add__", "__batch_step__"
CALLS = frozenset({_ADD, _STEP})  # what `follow` hands to `FollowerBatches`
_ids = itertools.count()
Key = Hashable


class Leader(Protocol):
    """What a `LeaderBatch` uses of rank 0's `executor.GroupExecutor`."""

    engine: Any
    group: Group

    def call_all(self, name: str, args: tuple[Any, ...], local: Callable[[], Any]) -> list[Any]: ...


class Stopped(Exception):
    """A request rank 0 stopped at this step (its interrupt raised): rank 0 reports what."""


@dataclass
class _Report:
    """One rank's answer to an add or a step: the requests of its share that finished, the
    tokens and logprobs each of its live requests' rows drew since its last report, and what
    failed (None: nothing)."""

    finished: Finished = field(default_factory=list)
    drawn: dict[Key, list[tuple[list[int], list[float]]]] = field(default_factory=dict)
    failure: str | None = None


class _Share:
    """One rank's share of a group's batch: its engine's `SampleBatch` with the requests this
    rank decodes, each stopped when rank 0 says."""

    def __init__(self, batch: Any, rank: int, sharded: bool) -> None:
        self.batch = batch
        self.rank = rank
        self.sharded = sharded
        # what rank 0 reads from this rank's report rather than from its own batch
        self._reports_drawn = rank != 0 and not sharded
        self._stopped: set[Key] = set()
        self._sent: dict[Key, list[int]] = {}  # per live request: tokens reported, per row

    def add(self, items: Sequence[tuple[Key, SampleRequest, int]]) -> _Report:
        mine = [
            (key, dataclasses.replace(request, interrupt=self._interrupt(key)))
            for key, request, owner in items
            if self.sharded or owner == self.rank
        ]
        return self._report(self.batch.add(mine), [key for key, _ in mine])

    def step(self, stopped: Sequence[Key]) -> _Report:
        self._stopped.update(stopped)
        return self._report(self.batch.step(), [])

    def _interrupt(self, key: Key) -> Callable[[], None]:
        def check() -> None:
            if key in self._stopped:
                raise Stopped(key)

        return check

    def _report(self, finished: Finished, joined: list[Key]) -> _Report:
        for key in joined if self._reports_drawn else ():
            self._sent[key] = []
        done = {key for key, _ in finished}
        drawn = {}
        for key, sent in list(self._sent.items()):
            if key in done:
                del self._sent[key]
                continue
            tokens_N, logprobs_N = self.batch.drawn(key)
            sent = sent or [0] * len(tokens_N)
            drawn[key] = [
                (t[s:], lp[s:]) for t, lp, s in zip(tokens_N, logprobs_N, sent, strict=True)
            ]
            self._sent[key] = [len(t) for t in tokens_N]
        self._stopped -= done
        return _Report(finished, drawn)


def _run(share: _Share, name: str, args: tuple[Any, ...]) -> _Report:
    try:
        if name == _ADD:
            return share.add(args[2])
        return share.step(args[1])
    except Exception as exc:  # noqa: BLE001  # every rank learns of it and drops the batch
        log.exception("rank %d's share of sample batch %s failed", share.rank, args[0])
        return _Report(failure=f"rank {share.rank}: {type(exc).__name__}: {exc}")


class FollowerBatches:
    """A rank other than 0's shares of the group's running batches, by batch id. A share with
    nothing left to decode is dropped; the next add to its batch opens a new one."""

    def __init__(self, engine: Any, group: Group) -> None:
        self.engine = engine
        self.group = group
        self._shares: dict[int, _Share] = {}

    def run(self, name: str, args: tuple[Any, ...]) -> None:
        """Run an add or a step of batch `args[0]` and send rank 0 this rank's report."""
        batch_id = args[0]
        report = self._run(name, args)
        if self.group.sharded:  # rank 0 decoded the same: only a failure is news to it
            report = _Report(failure=report.failure)
        every = gather(report)
        share = self._shares.get(batch_id)
        if share is not None and (
            any(r.failure is not None for r in every) or not len(share.batch)
        ):
            del self._shares[batch_id]

    def _run(self, name: str, args: tuple[Any, ...]) -> _Report:
        share = self._shares.get(args[0])
        if share is None:
            if name == _STEP:  # nothing of that batch here
                return _Report()
            try:
                share = _Share(self.engine.open_batch(args[1]), self.group.rank, self.group.sharded)
            except Exception as exc:  # noqa: BLE001  # rank 0 raises it for the batch
                return _Report(failure=f"rank {self.group.rank}: {type(exc).__name__}: {exc}")
            self._shares[args[0]] = share
        return _run(share, name, args)


class LeaderBatch:
    """Rank 0's side of a batch the whole group decodes (see the module's docstring)."""

    def __init__(self, leader: Leader, base_model: str) -> None:
        self._leader = leader
        self._group = leader.group
        self._base_model = base_model
        self._id = next(_ids)
        # rank 0's share (ValidationError for an unknown model, before the group hears of it)
        self._share = _Share(leader.engine.open_batch(base_model), 0, self._group.sharded)
        self._owner: dict[Key, int] = {}  # the live requests and the rank decoding each
        self._rows = [0] * self._group.world_size  # rows decoding on each rank
        self._samples: dict[Key, int] = {}
        self._interrupts: dict[Key, Callable[[], None]] = {}
        self._stopped: dict[Key, Exception] = {}  # what each stopped request's interrupt raised
        self._drawn: dict[Key, tuple[list[list[int]], list[list[float]]]] = {}  # decoded elsewhere

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, key: Key) -> bool:
        return key in self._owner

    def drawn(self, key: Key) -> tuple[list[list[int]], list[list[float]]]:
        """See `batching.DecodeBatch.drawn`."""
        if self._owner[key] == 0:
            return self._share.batch.drawn(key)  # type: ignore[no-any-return]
        return self._drawn[key]

    def add(self, requests: Sequence[tuple[Key, SampleRequest]]) -> Finished:
        items = []
        for key, request in requests:
            if key in self._owner:
                continue
            owner = (
                0
                if self._group.sharded
                else min(range(self._group.world_size), key=lambda r: (self._rows[r], r))
            )
            self._owner[key], self._samples[key] = owner, request.num_samples
            self._rows[owner] += request.num_samples
            if request.interrupt is not None:
                self._interrupts[key] = request.interrupt
            if owner != 0:
                self._drawn[key] = ([], [])
            items.append((key, dataclasses.replace(request, interrupt=None), owner))
        if not items:
            return []
        args = (self._id, self._base_model, items)
        return self._settle(
            self._leader.call_all(_ADD, args, lambda: _run(self._share, _ADD, args))
        )

    def step(self, interrupt: Callable[[], None] | None = None) -> Finished:
        """One step of every rank's share; what `interrupt` raises ends the call with the batch
        unchanged (nothing is sent); what a request's own interrupt raises is its result."""
        if interrupt is not None:
            interrupt()
        stopped = []
        for key, check in self._interrupts.items():
            if key in self._stopped:
                continue
            try:
                check()
            except Exception as exc:  # noqa: BLE001  # this request only: the others go on
                self._stopped[key] = exc
                stopped.append(key)
        args = (self._id, stopped)
        return self._settle(
            self._leader.call_all(_STEP, args, lambda: _run(self._share, _STEP, args))
        )

    def _settle(self, reports: list[_Report]) -> Finished:
        failures = [r.failure for r in reports if r.failure is not None]
        if failures:
            self._owner.clear()
            raise RuntimeError(f"the worker group's sample batch failed: {'; '.join(failures)}")
        finished: Finished = []
        for rank, report in enumerate(reports):
            if rank and self._group.sharded:
                continue
            for key, rows in report.drawn.items():
                if rank:
                    tokens_N, logprobs_N = self._drawn[key]
                    tokens_N.extend([] for _ in range(len(rows) - len(tokens_N)))
                    logprobs_N.extend([] for _ in range(len(rows) - len(logprobs_N)))
                    for row, (tokens, logprobs) in enumerate(rows):
                        tokens_N[row].extend(tokens)
                        logprobs_N[row].extend(logprobs)
            for key, result in report.finished:
                if isinstance(result, Stopped):
                    result = self._stopped[key]
                finished.append((key, result))
                self._rows[self._owner.pop(key)] -= self._samples.pop(key)
                self._interrupts.pop(key, None)
                self._stopped.pop(key, None)
                self._drawn.pop(key, None)
        return finished
