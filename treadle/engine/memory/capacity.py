"""Which base models this worker can host, and what each costs its memory, for its heartbeat:
placement, create_model and admission read it (platform/sessions/leases.py `hosts`,
platform/sessions/admission.py).

A model is hostable when its files are here (a registered folder readable at its path; the
SmolLM2 GGUF's package installed) and it fits the worker's memory budget per device: the
device's memory (the GPU's, or the host's on the CPU), or TREADLE_WORKER_MODEL_MEMORY bytes.
Given `measure` (engine/footprint.py's `model_footprint` with the worker's settings), each
model's footprint is computed once, in a background thread (a GGUF's config takes seconds to
read), and reported with the worker's `budget`: the model fits when its weights, one training
pass and the sampler's KV budget do and its loading fits host memory; the platform adds the
sessions' adapters (platform/sessions/admission.py). Until then, and for a worker given no
`measure`, a model fits when its weights with a tenth more (HEADROOM) do. A group in the
sharded layout holds a model's weights split across its ranks: each rank needs its share (the
embeddings and output head, whole on every rank, are counted as split too: an estimate).
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import torch

from treadle.platform.models.catalog import BaseModelInfo, gguf_path

# A model's footprint as reported (engine/footprint.Footprint.as_dict): bytes per device.
Measure = Callable[[BaseModelInfo], dict[str, Any]]

__all__ = ["HEADROOM", "Capacity", "device_memory", "device_memory_in_use"]

log = logging.getLogger(__name__)

HEADROOM = 1.1  # the weights plus a tenth for what each session adds


@functools.cache
def device_memory(device: torch.device) -> int:
    """Total bytes of `device`'s memory: the GPU's, or the host's RAM on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(psutil.virtual_memory().total)


def device_memory_in_use(device: torch.device) -> dict[str, float]:
    """This process's CUDA memory on `device` in bytes: "allocated" by tensors, "reserved" by
    the allocator; nothing on the CPU."""
    if device.type != "cuda":
        return {}
    return {
        "allocated": float(torch.cuda.memory_allocated(device)),
        "reserved": float(torch.cuda.memory_reserved(device)),
    }


class Capacity:
    """The models a worker on `device`, running weights in `dtype`, can host within
    `budget_bytes` (0: the device's memory) per device, its weights split `shards` ways.

    With `measure` (a model's footprint), each model's footprint is computed and reported too,
    with the budget: `resident_adapters` (the most adapters the device holds at once; 0: every
    one), `sampler_kv_tokens` and `host_memory_bytes` (0: the host's RAM)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        budget_bytes: int = 0,
        shards: int = 1,
        *,
        measure: Measure | None = None,
        resident_adapters: int = 0,
        sampler_kv_tokens: int = 0,
        host_memory_bytes: int = 0,
    ) -> None:
        self.device = device
        self.shards = shards
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.budget_bytes = budget_bytes or device_memory(device)
        self.measure = measure
        self.resident_adapters = resident_adapters
        self.sampler_kv_tokens = sampler_kv_tokens
        self.host_memory_bytes = host_memory_bytes or int(psutil.virtual_memory().total)
        self._files: dict[str, str | None] = {}
        self._footprints: dict[str, Future[dict[str, Any]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def refusal(self, info: BaseModelInfo) -> str | None:
        """Why this worker cannot host `info`, or None if it can."""
        if info.name not in self._files:
            self._files[info.name] = self._check_files(info)
        return self._files[info.name] or self._check_memory(info, self.model_footprint(info))

    def model_footprint(self, info: BaseModelInfo) -> dict[str, Any] | None:
        """`info`'s footprint once computed (its computation started on first ask), else None
        (no `measure`, not computed yet, or it could not be: logged)."""
        if self.measure is None:
            return None
        with self._lock:
            if info.name not in self._footprints:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="footprints")
                self._footprints[info.name] = self._pool.submit(self.measure, info)
            future = self._footprints[info.name]
        if not future.done():
            return None
        if (exc := future.exception()) is not None:
            if info.name not in self._warned:  # judged as before meanwhile (HEADROOM)
                log.warning("cannot compute %s's memory footprint: %s", info.name, exc)
                self._warned.add(info.name)
            return None
        return future.result()

    def wait(self, models: Iterable[BaseModelInfo], timeout: float | None = None) -> None:
        """Block until the footprints of `models` are computed (tests; a CLI)."""
        for info in models:
            self.model_footprint(info)
            future = self._footprints.get(info.name)
            if future is not None:
                future.exception(timeout)

    def report(self, models: Iterable[BaseModelInfo]) -> dict[str, Any]:
        """The heartbeat's part: the names it can host, why not the others, its budget, and
        (with settings) each computed footprint and the budget admission adds up against."""
        hostable, refused, footprints = [], {}, {}
        for info in models:
            why = self.refusal(info)
            if why is None:
                hostable.append(info.name)
            else:
                refused[info.name] = why
            if (fp := self.model_footprint(info)) is not None:
                footprints[info.name] = fp
        out: dict[str, Any] = {
            "models": hostable,
            "refused": refused,
            "device": str(self.device),
            "model_memory_bytes": self.budget_bytes,
        }
        if self.measure is not None:
            out["footprints"] = footprints
            out["budget"] = {
                "capacity_bytes": self.budget_bytes,
                "resident_adapters": self.resident_adapters,
                "sampler_kv_tokens": self.sampler_kv_tokens,
                "host_memory_bytes": self.host_memory_bytes,
            }
        return out

    def _check_files(self, info: BaseModelInfo) -> str | None:
        if info.kind == "gguf":
            try:
                if not os.access(gguf_path(info), os.R_OK):
                    return f"cannot read {gguf_path(info)} on this host"
            except FileNotFoundError as exc:  # the built-in's package is not installed
                return str(exc)
        if info.kind == "hf":
            folder = Path(info.path or "")
            if not os.access(folder / "config.json", os.R_OK):
                return f"cannot read {folder}/config.json on this host"
        return None

    def _check_memory(self, info: BaseModelInfo, fp: dict[str, Any] | None) -> str | None:
        split = f", split across {self.shards} ranks," if self.shards > 1 else ""
        if fp is None:  # not computed (yet): the weights and a tenth more
            needed = int(info.parameters * self.element_size * HEADROOM / self.shards)
            if needed > self.budget_bytes:
                return (
                    f"needs {_gib(needed)} per device for its {info.parameters:,} parameters in "
                    f"{self.element_size}-byte weights{split} (and a tenth more for its "
                    f"sessions); this worker has {_gib(self.budget_bytes)}"
                )
            return None
        weights, pass_bytes, kv = fp["weight_bytes"], fp["pass_bytes"], fp["kv_bytes"]
        needed = weights + pass_bytes + kv
        if needed > self.budget_bytes:
            return (
                f"needs {_gib(needed)} per device before any session: {_gib(weights)} "
                f"for its {info.parameters:,} parameters in {self.element_size}-byte "
                f"weights{split}, {_gib(pass_bytes)} for a training pass of "
                f"{fp['pass_tokens']:,} tokens (activations and logits), {_gib(kv)} for "
                f"the sampler's KV budget of {self.sampler_kv_tokens:,} tokens; this worker has "
                f"{_gib(self.budget_bytes)} (TREADLE_WORKER_MODEL_MEMORY)"
            )
        if fp["load_host_bytes"] > self.host_memory_bytes:
            return (
                f"loading it takes {_gib(fp['load_host_bytes'])} of host memory (the whole model "
                f"read on each of this host's ranks); this host has "
                f"{_gib(self.host_memory_bytes)} (TREADLE_WORKER_HOST_MEMORY)"
            )
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**24 else f"{n / 2**20:.2f} MiB"
