"""Which base models this worker can host, for its heartbeat: placement and create_model read
it (platform/sessions/leases.py `hosts`).

A model is hostable when its files are here (a registered folder readable at its path; the
SmolLM2 GGUF's package installed) and its weights, with a tenth more for the adapters,
optimizer state and activations of its sessions, fit the worker's memory budget: the device's
memory (the GPU's, or the host's on the CPU), or TREADLE_WORKER_MODEL_MEMORY bytes. A group in
the sharded layout holds a model's weights split across its ranks: each rank needs its share
(the embeddings and output head, whole on every rank, are counted as split too: an estimate).
Each model is checked once per process (a registry entry never changes). Must not import flask,
sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil
import torch

from treadle.platform.models.catalog import BaseModelInfo, gguf_path

__all__ = ["HEADROOM", "Capacity", "device_memory", "device_memory_in_use"]

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
    `budget_bytes` (0: the device's memory) per device, its weights split `shards` ways."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, budget_bytes: int = 0, shards: int = 1
    ) -> None:
        self.device = device
        self.shards = shards
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.budget_bytes = budget_bytes or device_memory(device)
        self._checked: dict[str, str | None] = {}

    def refusal(self, info: BaseModelInfo) -> str | None:
        """Why this worker cannot host `info`, or None if it can."""
        if info.name not in self._checked:
            self._checked[info.name] = self._check(info)
        return self._checked[info.name]

    def report(self, models: Iterable[BaseModelInfo]) -> dict[str, Any]:
        """The heartbeat's part: the names it can host, why not the others, its budget."""
        hostable, refused = [], {}
        for info in models:
            why = self.refusal(info)
            if why is None:
                hostable.append(info.name)
            else:
                refused[info.name] = why
        return {
            "models": hostable,
            "refused": refused,
            "device": str(self.device),
            "model_memory_bytes": self.budget_bytes,
        }

    def _check(self, info: BaseModelInfo) -> str | None:
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
        needed = int(info.parameters * self.element_size * HEADROOM / self.shards)
        if needed > self.budget_bytes:
            split = f", split across {self.shards} ranks," if self.shards > 1 else ""
            return (
                f"needs {_gib(needed)} per device for its {info.parameters:,} parameters in "
                f"{self.element_size}-byte weights{split} (and a tenth more for its sessions); "
                f"this worker has {_gib(self.budget_bytes)}"
            )
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**24 else f"{n / 2**20:.2f} MiB"
