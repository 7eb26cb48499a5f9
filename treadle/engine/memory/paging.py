"""Where each adapter's training state lives: on the accelerator, in host memory, or on disk.

Owns two least-recently-used orders over the engine's adapters: at most `max_resident` on the
accelerator (the others wait in host memory), and at most `max_loaded` in memory at all, the
accelerator's included (the others are written to one file per adapter under `spill_dir` and
freed, the freed pages handed back to the OS). Using an adapter brings it back, bit for bit:
weights, pending grads, AdamW moments and step counters. Snapshots for sampling are separate
tensors and never page. The engine calls this under its lock.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file

from treadle.engine.memory.heap import release_excess

__all__ = ["Paging", "SPILL_SUFFIX", "owned", "page_out", "write_spill_file"]

log = logging.getLogger(__name__)

SPILL_SUFFIX = ".adapter.safetensors"
_CPU = torch.device("cpu")


class Paged(Protocol):
    """An adapter's training state as paging moves it (`lora.adapters.TrainableLora`)."""

    def move_to(self, device: torch.device) -> None: ...

    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    def release(self) -> None: ...

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None: ...


class Paging:
    """The adapters' places. `loras(adapter_id)` gives an adapter's training state (`Paged`: a `lora.TrainableLora`; its object
    stays for the adapter's lifetime; paging frees and restores its tensors in place).

    `max_loaded` None keeps every adapter in memory and writes nothing. `spill_dir` None with a
    limit: a fresh temporary folder, removed when this object goes. A given `spill_dir` is this
    engine's alone: spill files left in it by an earlier process are deleted now.
    """

    def __init__(
        self,
        loras: Callable[[str], Paged],
        *,
        device: torch.device,
        max_resident: int,
        max_loaded: int | None = None,
        spill_dir: Path | None = None,
    ) -> None:
        if max_resident < 1:
            raise ValueError(f"max_resident_adapters is {max_resident}; use 1 or more")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded_adapters is {max_loaded}; use 1 or more (or None)")
        self._loras = loras
        self.device = device
        self.max_resident = max_resident
        self.max_loaded = max_loaded
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._loaded: OrderedDict[str, None] = OrderedDict()  # in memory; a superset of resident
        self._files: dict[str, Path] = {}  # adapter id -> its spill file, while paged out
        self._names = itertools.count()
        self.spill_dir: Path | None = None
        if max_loaded is not None:
            if spill_dir is None:
                self.spill_dir = Path(tempfile.mkdtemp(prefix="treadle-spill-"))
                weakref.finalize(self, shutil.rmtree, self.spill_dir, True)
            else:
                self.spill_dir = Path(spill_dir)
                self.spill_dir.mkdir(parents=True, exist_ok=True)
                for stale in self.spill_dir.glob(f"*{SPILL_SUFFIX}*"):
                    stale.unlink(missing_ok=True)

    def resident(self) -> list[str]:
        """Adapters counted as on the accelerator, least recently used first."""
        return list(self._resident)

    def loaded(self) -> list[str]:
        """Adapters in memory (on the accelerator or the host), least recently used first."""
        return list(self._loaded)

    def spilled(self) -> dict[str, Path]:
        """Adapters paged out to disk, with their files."""
        return dict(self._files)

    def counts(self) -> tuple[int, int]:
        """(adapters in memory, adapters paged out to disk). Safe without the engine's lock (each
        len() is one atomic read), so a metrics scrape never waits for a running operation."""
        return len(self._loaded), len(self._files)

    def use(self, adapter_id: str, *, on_device: bool) -> Paged:
        """The adapter's state, read back from disk if it was paged out and marked most recently
        used; with `on_device`, moved onto the accelerator too. Then the least recently used
        others beyond the limits move to host memory or out to disk."""
        lora = self._loras(adapter_id)
        if adapter_id in self._files:
            self._make_room(adapter_id, room=1)  # first, so memory never holds one too many
            self._read_back(adapter_id, lora)
        self._loaded[adapter_id] = None
        self._loaded.move_to_end(adapter_id)
        if on_device:
            lora.move_to(self.device)
            self._resident[adapter_id] = None
            self._resident.move_to_end(adapter_id)
        while len(self._resident) > self.max_resident:
            idle, _ = self._resident.popitem(last=False)
            if self.device.type != "cpu":
                self._loras(idle).move_to(_CPU)
        self._make_room(adapter_id, room=0)
        return lora

    def forget(self, adapter_id: str) -> None:
        """Stop tracking a dropped adapter and delete its spill file, if any."""
        self._resident.pop(adapter_id, None)
        self._loaded.pop(adapter_id, None)
        path = self._files.pop(adapter_id, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def _make_room(self, keep: str, *, room: int) -> None:
        """Page out the least recently used adapters but `keep` until `room` more fit."""
        if self.max_loaded is None:
            return
        excess = len(self._loaded) + room - self.max_loaded
        page_out([a for a in self._loaded if a != keep], excess, self._spill)

    def _spill(self, adapter_id: str) -> bool:
        """Write the adapter's state to its file (atomically: a temporary file renamed into
        place), then free it. False, keeping it in memory, if the file cannot be written."""
        assert self.spill_dir is not None
        lora = self._loras(adapter_id)
        lora.move_to(_CPU)
        path = self.spill_dir / f"{next(self._names)}{SPILL_SUFFIX}"
        tensors = {name: t.contiguous() for name, t in lora.state_tensors().items()}
        if not write_spill_file(path, tensors, f"adapter {adapter_id}"):
            return False
        lora.release()
        self._resident.pop(adapter_id, None)
        self._loaded.pop(adapter_id, None)
        self._files[adapter_id] = path
        return True

    def _read_back(self, adapter_id: str, lora: Paged) -> None:
        path = self._files[adapter_id]
        try:
            tensors = load_file(str(path), device="cpu")
        except Exception as exc:  # OSError, or safetensors' error for a damaged file
            raise RuntimeError(
                f"adapter {adapter_id!r} was paged out to {path} and cannot be read back ({exc}); "
                "its session must be rebuilt from its checkpoint"
            ) from exc
        lora.restore({name: owned(t) for name, t in tensors.items()})
        del self._files[adapter_id]
        path.unlink(missing_ok=True)


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (read from a spill file) in memory of its own. safetensors reads a file's
    tensors as views into one buffer, each at its offset in the file, which need not be aligned
    the way the allocator aligns a tensor; a matrix product's result can depend on its operands'
    alignment (MKL's can), so a paged-in adapter or snapshot would compute other bits than it did
    before it went out."""
    return tensor.clone(memory_format=torch.contiguous_format)


def page_out(least_recent_first: list[str], excess: int, spill: Callable[[str], bool]) -> None:
    """Spill the first `excess` ids (least recently used first) with `spill`, stopping at the
    first it cannot write, then hand the freed memory back to the OS if the heap keeps too much."""
    spilled = 0
    for idle in least_recent_first[: max(0, excess)]:
        if not spill(idle):
            break
        spilled += 1
    if spilled:
        release_excess()


def write_spill_file(
    path: Path, tensors: dict[str, torch.Tensor], what: str, metadata: dict[str, str] | None = None
) -> bool:
    """Write `tensors` to `path` atomically (a temporary file renamed into place). False, logged,
    if it cannot be written: a full or failing disk leaves `what` in memory, over its limit,
    rather than failing the operation that needed the room."""
    partial = path.with_name(path.name + ".partial")
    try:
        save_file(tensors, str(partial), metadata)
        os.replace(partial, path)
    except Exception:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        log.warning("could not page %s out to %s; keeping it in memory", what, path, exc_info=True)
        return False
    return True
