"""The engine's declared interfaces: `EngineAPI` (what the worker calls) and `Parallelism` (how
a forward_backward's parts are spread across processes).

`EngineAPI` is satisfied by the single-process `Engine` and by the group's
`distributed.executor.GroupExecutor`; the worker holds one or the other and never asks which.
Every call that changes what an adapter or a snapshot holds, or runs the base model for
training, carries the `changes_adapter` marker: a group runs exactly those on every rank
(`adapter_calls`; after those marked `sets_weights` every rank's weights are compared), the
rest on rank 0 alone. `Parallelism` is applied to the engine's compute
from outside, as torchtitan applies its parallelisms: `Alone` computes every part here, a
worker group's `distributed.group.Group` computes this rank's share, hands each rank every
part, and shards the base models' layers in its sharded layout.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from treadle.engine.dimuon import DimuonSpec
from treadle.engine.gradients import combine, units_of
from treadle.engine.lora.adapters import LoraSpec
from treadle.engine.losses.functions import EngineDatum
from treadle.engine.optim import AdamSpec
from treadle.engine.sampling.decode import Finished, Key, SampleRequest
from treadle.engine.sampling.rules import SampleResult
from treadle.platform.errors import NotFoundError, ValidationError

__all__ = [
    "ALONE",
    "STATE_PARTS",
    "Alone",
    "EngineAPI",
    "ForwardBackwardResult",
    "Interrupt",
    "Parallelism",
    "Part",
    "SampleBatchAPI",
    "Topology",
    "adapter_calls",
    "changes_adapter",
    "decode_all",
    "sets_weights",
    "weight_setting_calls",
]

Interrupt = Callable[[], None]  # raises to stop a long call at its next step boundary
# The parts of an adapter's state `state_hashes` can fingerprint.
STATE_PARTS = ("weights", "grads", "optimizer")

_CHANGES = "__treadle_changes_adapter__"
_SETS = "__treadle_sets_weights__"
_F = TypeVar("_F", bound=Callable[..., object])


def changes_adapter(method: _F) -> _F:
    """Mark an `EngineAPI` call that changes what an adapter or snapshot holds (or runs the base
    model for training): a worker group runs it on every rank, in the same order."""
    setattr(method, _CHANGES, True)
    return method


def sets_weights(method: _F) -> _F:
    """`changes_adapter`, for a call that sets an adapter's weights (its first argument): after
    it a worker group checks that every rank holds the same weights."""
    setattr(method, _SETS, True)
    return changes_adapter(method)


def _marked(mark: str) -> frozenset[str]:
    return frozenset(
        name
        for name, member in inspect.getmembers(EngineAPI, inspect.isfunction)
        if getattr(member, mark, False)
    )


def adapter_calls() -> frozenset[str]:
    """The names of `EngineAPI`'s calls marked `changes_adapter` (`sets_weights` included)."""
    return _marked(_CHANGES)


def weight_setting_calls() -> frozenset[str]:
    """The names of `EngineAPI`'s calls marked `sets_weights`."""
    return _marked(_SETS)


@dataclass
class ForwardBackwardResult:
    # per datum: logprobs, elementwise_loss; float32 [T_i] (cross_entropy's top-K: [T_i, K])
    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]  # "loss:sum", and `sampler_kl.KL_METRICS` where q was sent
    train_tokens: int
    pass_tokens: int  # the pass budget it ran with: a replay passes it back for the same bits


@dataclass
class Part:
    """One part of a forward_backward: its data's outputs and its summed loss (its gradient
    goes into its unit's sum: `gradients`)."""

    outputs: list[dict[str, np.ndarray]]
    loss: float


@dataclass(frozen=True)
class Topology:
    """A worker group as the platform sees it: its world size, how it holds base models
    (`layout`), its collectives' timeout, and its ranks per host (`node_size`; 0: one host)."""

    world_size: int
    layout: str
    timeout_seconds: float
    node_size: int = 0

    @property
    def shards(self) -> int:
        """Into how many parts each base model's decoder layers are split: across a host's
        ranks (each host of a group on several holds a whole copy, sharded)."""
        if self.layout != "sharded":
            return 1
        return self.node_size or self.world_size


class WeightSource(Protocol):
    """Where a model built on the meta device reads its parameters (`models.weight_files`)."""

    def materialize(self, module: nn.Module) -> int:
        """Give every meta parameter under `module` its values, in host memory."""
        ...

    def rows(self, param: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the meta parameter `param`, in host memory."""
        ...


class Parallelism(Protocol):
    """How an engine's compute is spread: which passes of a forward_backward run here, how the
    parts' results reach every process, and whether base models are sharded."""

    @property
    def sharded(self) -> bool: ...

    def units(self, count: int) -> list[range]:
        """The `count` parts cut into the subtrees of their gradient's sum that one process
        computes alone (`gradients.units_of`)."""
        ...

    def passes(self, tokens_P: Sequence[int]) -> list[tuple[int, bool]]:
        """The parts this process computes, whole `units` of them, in order, each with whether
        its result is kept (False: a pass run only so that the processes' collectives pair
        up)."""
        ...

    def exchange(
        self, mine: dict[int, Part], sums: dict[int, torch.Tensor], units: Sequence[range]
    ) -> tuple[list[Part], torch.Tensor | None]:
        """Every part, in order, from this process's `mine`, and the request's gradient (flat;
        None in a forward only) from its units' `sums`, added in the canonical tree
        (`gradients`): the same bits wherever the units were computed."""
        ...

    def shard(self, model: nn.Module, device: torch.device, files: WeightSource | None) -> int:
        """Split `model`'s decoder layers across the processes (when `sharded`), reading the
        parameters still on the meta device from `files` as it goes."""
        ...


class Alone:
    """One process computes everything."""

    sharded = False

    def units(self, count: int) -> list[range]:
        return units_of(count, 1)

    def passes(self, tokens_P: Sequence[int]) -> list[tuple[int, bool]]:
        return [(p, True) for p in range(len(tokens_P))]

    def exchange(
        self, mine: dict[int, Part], sums: dict[int, torch.Tensor], units: Sequence[range]
    ) -> tuple[list[Part], torch.Tensor | None]:
        count = sum(len(unit) for unit in units)
        assert sorted(mine) == list(range(count)), (sorted(mine), count)
        return [mine[p] for p in range(count)], combine(sums, units)

    def shard(self, model: nn.Module, device: torch.device, files: WeightSource | None) -> int:
        raise AssertionError("a process alone shards nothing")


ALONE = Alone()


class SampleBatchAPI(Protocol):
    """A continuous batch of sample requests on one base model: requests join (`add`) between
    decoding steps (`step`) and leave when done, each with its result or error."""

    def __len__(self) -> int: ...

    def __contains__(self, key: Key) -> bool: ...

    def add(self, requests: Sequence[tuple[Key, SampleRequest]]) -> Finished: ...

    def step(self, interrupt: Interrupt | None = None) -> Finished: ...

    def drawn(self, key: Key) -> tuple[list[list[int]], list[list[float]]]: ...


def decode_all(
    open_batch: Callable[[str], SampleBatchAPI],
    requests: Sequence[SampleRequest],
    interrupt: Interrupt | None = None,
) -> list[SampleResult | Exception]:
    """Every request's result or its error, decoded in one batch per base model (`open_batch`
    opens one); a request's tokens and logprobs do not depend on the others. `interrupt` is
    called before each decoding step and what it raises ends the call; each request's own
    `interrupt` ends only that request, with what it raised as its result."""
    results: dict[Key, SampleResult | Exception] = {}
    by_base: dict[str, list[tuple[Key, SampleRequest]]] = {}
    for i, request in enumerate(requests):
        by_base.setdefault(request.base_model, []).append((i, request))
    for base_model, keyed in by_base.items():
        try:
            batch = open_batch(base_model)
        except (ValidationError, NotFoundError) as exc:
            results.update((i, exc) for i, _ in keyed)
            continue
        results.update(batch.add(keyed))
        while len(batch):
            results.update(batch.step(interrupt))
    return [results[i] for i in range(len(requests))]


@runtime_checkable
class EngineAPI(Protocol):
    """LoRA training and sampling for many adapters on shared base models, addressed by id:
    token ids in, one result or one error per call out (`engine.Engine` documents each)."""

    device: torch.device
    dtype: torch.dtype

    # -- models and adapters

    def tokenizer(self, base_model: str) -> PreTrainedTokenizerBase: ...

    def has_base(self, base_model: str) -> bool: ...

    @sets_weights
    def create_adapter(self, adapter_id: str, base_model: str, lora: LoraSpec) -> None: ...

    def has_adapter(self, adapter_id: str) -> bool: ...

    @changes_adapter
    def drop_adapter(self, adapter_id: str, *, keep_snapshots: bool = False) -> None: ...

    def adapter_counts(self) -> tuple[int, int]: ...

    def snapshot_counts(self) -> tuple[int, int]: ...

    def adapter_weights(self, adapter_id: str) -> dict[str, np.ndarray]: ...

    @sets_weights
    def set_adapter_weights(self, adapter_id: str, weights: Mapping[str, np.ndarray]) -> None: ...

    def adapter_grads(self, adapter_id: str) -> dict[str, np.ndarray]: ...

    def weight_hash(self, adapter_id: str) -> str: ...

    def state_hashes(
        self, adapter_id: str, parts: Sequence[str] = STATE_PARTS
    ) -> dict[str, str]: ...

    # -- training

    @changes_adapter
    def forward_backward(
        self,
        adapter_id: str,
        data: Sequence[EngineDatum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        forward_only: bool = False,
        pass_tokens: int | None = None,
        interrupt: Interrupt | None = None,
        custom_loss: Mapping[str, Any] | None = None,
    ) -> ForwardBackwardResult: ...

    @sets_weights
    def optim_step(self, adapter_id: str, adam: AdamSpec | DimuonSpec) -> dict[str, float]: ...

    # -- sampling

    @changes_adapter
    def snapshot(self, adapter_id: str, snapshot_id: str) -> None: ...

    def has_snapshot(self, snapshot_id: str) -> bool: ...

    @changes_adapter
    def drop_snapshot(self, snapshot_id: str) -> None: ...

    def sample_batch(
        self, requests: Sequence[SampleRequest], *, interrupt: Interrupt | None = None
    ) -> list[SampleResult | Exception]: ...

    def open_batch(self, base_model: str) -> SampleBatchAPI: ...

    def samples_beside_training(self) -> bool:
        """Whether sample batches may run on another thread while a training call runs (their
        engine is not the one training: vLLM's processes)."""
        ...

    # -- files

    def export_adapter(self, adapter_id: str, folder: Path, *, with_optimizer: bool) -> None: ...

    @sets_weights
    def import_adapter(
        self,
        adapter_id: str,
        base_model: str,
        folder: Path,
        *,
        with_optimizer: bool,
        optimizer: str | None = None,
    ) -> None: ...

    def export_merged(self, adapter_id: str, folder: Path) -> None: ...

    @changes_adapter
    def load_snapshot(self, snapshot_id: str, base_model: str, folder: Path) -> None: ...

    # -- the process (or group) itself

    def topology(self) -> Topology | None:
        """The worker group this engine drives (None: one process)."""
        ...

    def rank_memory(self) -> dict[int, dict[str, float]]:
        """Device memory in use by kind, per rank (rank 0: now; the others: as of the last
        `ping`)."""
        ...

    def ping(self) -> None:
        """Between calls: check that every rank is alive (a dead one ends the group here)."""
        ...

    def close(self) -> None:
        """The worker is ending: release what the engine holds (a group's other ranks stop)."""
        ...
