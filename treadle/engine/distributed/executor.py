"""How rank 0 drives a worker group: `GroupExecutor` on rank 0, `follow` on the others.

Rank 0 is the worker the platform sees (it consumes the session queues, holds the leases and
settles); its engine is a `GroupExecutor`, which implements `protocol.EngineAPI` for the whole
group: every call that carries the `changes_adapter` marker is sent to the other ranks (a
broadcast of the call's name and arguments) before it runs on rank 0's own engine, so every
rank's engine sees the same calls in the same order; every other call runs on rank 0 alone,
whose adapter is the whole adapter. The other ranks run `follow`: receive a call, run it, until
rank 0 closes the group or a collective times out. After each mirrored call every rank checks
that all ended the same way (the same error or none; after a call that sets weights, the same
weight hash): a rank that differs fails the group rather than train on other weights than rank 0
reports. Sampling runs on the whole group (`decoding`), or, where rank 0's engine samples with
vLLM, on rank 0's vLLM server alone, beside the group's training calls; in the sharded layout a
base model's first batch is preceded by its load on every rank together (loading shards it, a
collective).
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from treadle.engine.dimuon import DimuonSpec
from treadle.engine.distributed.decoding import CALLS, FollowerBatches, LeaderBatch
from treadle.engine.distributed.group import Group, broadcast, fail, gather, leave
from treadle.engine.engine import Engine
from treadle.engine.lora.adapters import LoraSpec
from treadle.engine.losses.functions import EngineDatum
from treadle.engine.memory.capacity import device_memory_in_use
from treadle.engine.optim import AdamSpec
from treadle.engine.protocol import (
    STATE_PARTS,
    ForwardBackwardResult,
    Interrupt,
    Topology,
    adapter_calls,
    decode_all,
    weight_setting_calls,
)
from treadle.engine.sampling.decode import SampleRequest
from treadle.engine.sampling.rules import SampleResult
from treadle.engine.sampling.vllm_batch import VllmBatch

__all__ = ["MIRRORED", "SETS_WEIGHTS", "GroupExecutor", "follow"]

log = logging.getLogger(__name__)

# The calls every rank runs: those `protocol.EngineAPI` marks as changing an adapter.
MIRRORED = adapter_calls()
# Mirrored calls after which every rank's adapter weights are compared (by hash): `sets_weights`.
SETS_WEIGHTS = weight_setting_calls()
_CLOSE = "__close__"
_PING = "__ping__"
_LOAD_BASE = "__load_base__"  # a base model a sharded group loads before its first sample


class GroupExecutor:
    """Rank 0's `EngineAPI` for a worker group over its own `engine` (see the module's
    docstring). A mirrored call's `interrupt` keyword runs on rank 0, once, before the call is
    sent (a call the group has started runs to its end on every rank)."""

    def __init__(self, engine: Engine, group: Group) -> None:
        assert group.is_leader
        self.engine = engine
        self.group = group
        self.device: torch.device = engine.device
        self.dtype: torch.dtype = engine.dtype
        # One call in flight across the group: a ping never lands inside a call's collectives.
        self._sending = threading.Lock()
        # Each rank's device memory in use by kind (`capacity.device_memory_in_use`), as of the
        # last ping: the worker's metrics show every rank's.
        self._rank_memory: dict[int, dict[str, float]] = {}

    # -- calls on rank 0 alone

    def tokenizer(self, base_model: str) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer(base_model)

    def has_adapter(self, adapter_id: str) -> bool:
        return self.engine.has_adapter(adapter_id)

    def has_base(self, base_model: str) -> bool:
        return self.engine.has_base(base_model)  # every rank loads the same bases

    def adapter_counts(self) -> tuple[int, int]:
        return self.engine.adapter_counts()

    def snapshot_counts(self) -> tuple[int, int]:
        return self.engine.snapshot_counts()

    def adapter_weights(self, adapter_id: str) -> dict[str, np.ndarray]:
        return self.engine.adapter_weights(adapter_id)

    def adapter_grads(self, adapter_id: str) -> dict[str, np.ndarray]:
        return self.engine.adapter_grads(adapter_id)

    def weight_hash(self, adapter_id: str) -> str:
        return self.engine.weight_hash(adapter_id)

    def state_hashes(self, adapter_id: str, parts: Sequence[str] = STATE_PARTS) -> dict[str, str]:
        return self.engine.state_hashes(adapter_id, parts)

    def has_snapshot(self, snapshot_id: str) -> bool:
        return self.engine.has_snapshot(snapshot_id)

    def export_adapter(self, adapter_id: str, folder: Path, *, with_optimizer: bool) -> None:
        self.engine.export_adapter(adapter_id, folder, with_optimizer=with_optimizer)

    def export_merged(self, adapter_id: str, folder: Path) -> None:
        self.engine.export_merged(adapter_id, folder)

    # -- calls every rank runs (marked `changes_adapter` in `EngineAPI`)

    def create_adapter(self, adapter_id: str, base_model: str, lora: LoraSpec) -> None:
        self._mirror("create_adapter", adapter_id, base_model, lora)

    def drop_adapter(self, adapter_id: str, *, keep_snapshots: bool = False) -> None:
        self._mirror("drop_adapter", adapter_id, keep_snapshots=keep_snapshots)

    def set_adapter_weights(self, adapter_id: str, weights: Mapping[str, np.ndarray]) -> None:
        self._mirror("set_adapter_weights", adapter_id, weights)

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
    ) -> ForwardBackwardResult:
        if pass_tokens is None and self.engine.has_adapter(adapter_id):
            # Rank 0's budget for every rank: the ranks must cut the request the same way,
            # whatever their own memory says.
            pass_tokens = self.engine.pass_budget(adapter_id)
        result: ForwardBackwardResult = self._mirror(
            "forward_backward",
            adapter_id,
            data,
            loss_fn,
            loss_fn_config,
            forward_only=forward_only,
            pass_tokens=pass_tokens,
            interrupt=interrupt,
            custom_loss=custom_loss,
        )
        return result

    def optim_step(self, adapter_id: str, adam: AdamSpec | DimuonSpec) -> dict[str, float]:
        metrics: dict[str, float] = self._mirror("optim_step", adapter_id, adam)
        return metrics

    def snapshot(self, adapter_id: str, snapshot_id: str) -> None:
        self._mirror("snapshot", adapter_id, snapshot_id)

    def drop_snapshot(self, snapshot_id: str) -> None:
        self._mirror("drop_snapshot", snapshot_id)

    def import_adapter(
        self,
        adapter_id: str,
        base_model: str,
        folder: Path,
        *,
        with_optimizer: bool,
        optimizer: str | None = None,
    ) -> None:
        self._mirror(
            "import_adapter",
            adapter_id,
            base_model,
            folder,
            with_optimizer=with_optimizer,
            optimizer=optimizer,
        )

    def load_snapshot(self, snapshot_id: str, base_model: str, folder: Path) -> None:
        self._mirror("load_snapshot", snapshot_id, base_model, folder)

    # -- sampling: each batch a `LeaderBatch` the whole group decodes

    def open_batch(self, base_model: str) -> LeaderBatch | VllmBatch:
        """A batch the whole group decodes (`LeaderBatch`) or, when rank 0's engine samples
        with vLLM, rank 0's own batch on its vLLM server: the other ranks take no part (a
        sample reads only its snapshot, whole on rank 0, as every adapter is)."""
        if self.group.sharded and not self.engine.has_base(base_model):
            # Loading shards the model, a collective: every rank loads it now, together (rank 0
            # alone in it would wait on the others' next call until the group's timeout). With
            # vLLM too: rank 0 reads the base's tokenizer and LoRA shapes from it.
            with self._sending:
                broadcast((_LOAD_BASE, (base_model,), {}))
                _, error = _run(self.engine, "load_base", (base_model,), {})
            if error is not None:
                raise error
        if self.engine.samples_beside_training():
            batch = self.engine.open_batch(base_model)
            assert isinstance(batch, VllmBatch)
            return batch
        return LeaderBatch(self, base_model)

    def samples_beside_training(self) -> bool:
        """With vLLM, rank 0's samples run beside the group's training calls (they use no
        collective); otherwise the group's ranks decode together, between its training calls."""
        return self.engine.samples_beside_training()

    def sample_batch(
        self, requests: Sequence[SampleRequest], *, interrupt: Interrupt | None = None
    ) -> list[SampleResult | Exception]:
        return decode_all(self.open_batch, requests, interrupt)

    def call_all(self, name: str, args: tuple[Any, ...], local: Callable[[], Any]) -> list[Any]:
        """Send `name(*args)` to the other ranks, run `local` here, and gather every rank's
        answer (rank 0's is what `local` returned)."""
        with self._sending:
            broadcast((name, args, {}))
            return gather(local())

    # -- the group itself

    def topology(self) -> Topology:
        return self.group.topology

    def rank_memory(self) -> dict[int, dict[str, float]]:
        return {**self._rank_memory, 0: device_memory_in_use(self.device)}

    def ping(self) -> None:
        """While no call is in flight, show the other ranks the group is alive (they wait for
        the next call at most the group's timeout), learn whether they are, and read each
        one's device memory."""
        if self._sending.acquire(blocking=False):
            try:
                broadcast((_PING, (), {}))
                every = gather(device_memory_in_use(self.device))
                self._rank_memory = dict(enumerate(every))
            finally:
                self._sending.release()

    def close(self) -> None:
        """Tell the other ranks to stop following, then leave the group."""
        with self._sending:
            broadcast((_CLOSE, (), {}))
        leave(self.engine)

    def _mirror(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run `name` on every rank: only a call `EngineAPI` marks `changes_adapter`."""
        if name not in MIRRORED:
            raise AssertionError(f"{name} is not marked changes_adapter in EngineAPI")
        return self._send(name, args, kwargs)

    def _send(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        interrupt: Interrupt | None = kwargs.pop("interrupt", None)
        with self._sending:
            if interrupt is not None:
                interrupt()
            broadcast((name, args, kwargs))
            result, error = _run(self.engine, name, args, kwargs)
        if error is not None:
            raise error
        return result


def follow(engine: Engine, group: Group) -> None:
    """A rank other than 0: run each call rank 0 sends on `engine`, until it closes the group.
    A call's error is the same on every rank (the same inputs): it is logged and the rank goes
    on, as rank 0 reports it to the client."""
    batches = FollowerBatches(engine, group)
    while True:
        name, args, kwargs = broadcast(None)
        if name == _CLOSE:
            return
        if name == _PING:
            gather(device_memory_in_use(engine.device))
            continue
        if name in CALLS:
            batches.run(name, args)
            continue
        if name == _LOAD_BASE:
            _run(engine, "load_base", args, kwargs)  # an error: rank 0 reports it
            continue
        if name not in MIRRORED:  # a newer rank 0 than this rank: the group cannot agree
            fail(f"rank 0 sent {name!r}, which this rank does not run")
        _, error = _run(engine, name, args, kwargs)
        if error is not None:  # the same as rank 0's (`_run` checked), which reports it
            log.info("rank call %s failed as on rank 0: %s", name, error)


def _run(
    engine: Engine, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
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
    if error is None and name in SETS_WEIGHTS:
        weights = engine.weight_hash(args[0] if args else kwargs["adapter_id"])
    outcome = (type(error).__name__ if error is not None else None, weights)
    every = gather(outcome)
    if any(o != every[0] for o in every):
        fail(f"the ranks of the worker group disagree after {name}: {every}")
    return result, error
