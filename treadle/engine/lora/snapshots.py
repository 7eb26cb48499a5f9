"""Snapshots for sampling: frozen LoRA weights by id, in memory or paged out to local disk.

Owns `Snapshot` (the frozen weights, their base model, the adapter they were taken from) and
`Snapshots`, the engine's table of them: at most `max_loaded` in memory, the least recently used
others written to one file each under `spill_dir` and read back, bit for bit, when next used. An
RL loop takes a snapshot every step (`save_weights_and_get_sampling_client`) and never samples the
old ones again, so without a limit a session's memory grows by one adapter's weights a step. The
table takes its own lock: vLLM's samples read it while a training call holds the engine's. Must
not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from treadle.engine.lora.adapters import LoraWeights
from treadle.engine.memory.paging import owned, page_out, write_spill_file
from treadle.platform.errors import UnavailableError

__all__ = ["SNAPSHOT_SUFFIX", "Snapshot", "Snapshots"]

SNAPSHOT_SUFFIX = ".snapshot.safetensors"


@dataclass(frozen=True)
class Snapshot:
    adapter_id: str | None  # None: loaded from files, or its adapter is gone
    base_model: str
    weights: LoraWeights


@dataclass(frozen=True)
class _Spilled:
    """A snapshot paged out: everything but its tensors, which are in `path`."""

    adapter_id: str | None
    base_model: str
    path: Path


class Snapshots:
    """Snapshots by id. `max_loaded` None keeps every one in memory and writes nothing.
    `spill_dir` None with a limit: a fresh temporary folder, made when first needed and removed
    when this object goes. In a given `spill_dir`, snapshot files left by an earlier process are
    deleted now (the adapters' spill files beside them are `paging`'s)."""

    def __init__(
        self, *, device: torch.device, max_loaded: int | None, spill_dir: Path | None
    ) -> None:
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded_snapshots is {max_loaded}; use 1 or more (or None)")
        self.device = device
        self.max_loaded = max_loaded
        self._loaded: OrderedDict[str, Snapshot] = OrderedDict()  # least recently used first
        self._spilled: dict[str, _Spilled] = {}
        self._names = itertools.count()
        self._spill_dir = spill_dir
        self._lock = threading.RLock()
        if spill_dir is not None and max_loaded is not None:
            spill_dir.mkdir(parents=True, exist_ok=True)
            for stale in spill_dir.glob(f"*{SNAPSHOT_SUFFIX}*"):
                stale.unlink(missing_ok=True)

    def __contains__(self, snapshot_id: object) -> bool:
        with self._lock:
            return snapshot_id in self._loaded or snapshot_id in self._spilled

    def counts(self) -> tuple[int, int]:
        """(snapshots in memory, snapshots paged out to disk)."""
        with self._lock:
            return len(self._loaded), len(self._spilled)

    def spilled(self) -> dict[str, Path]:
        """The snapshots paged out to disk, each with its file."""
        with self._lock:
            return {snapshot_id: s.path for snapshot_id, s in self._spilled.items()}

    def put(self, snapshot_id: str, snapshot: Snapshot) -> None:
        """Keep `snapshot` under `snapshot_id` (replacing any), as the most recently used."""
        with self._lock:
            self.drop(snapshot_id)
            self._loaded[snapshot_id] = snapshot
            self._make_room(keep=snapshot_id)

    def get(self, snapshot_id: str) -> Snapshot | None:
        """The snapshot (read back from disk if it was paged out), marked most recently used;
        None if there is none of that id. UnavailableError, forgetting it, if its file cannot be
        read back."""
        with self._lock:
            if snapshot_id in self._spilled:
                spilled = self._spilled.pop(snapshot_id)
                try:  # gone either way: what cannot be read back is rebuilt from the log
                    weights = _read(spilled.path, snapshot_id, self.device)
                finally:
                    spilled.path.unlink(missing_ok=True)
                snap = Snapshot(spilled.adapter_id, spilled.base_model, weights)
                self._loaded[snapshot_id] = snap
                self._make_room(keep=snapshot_id)
            snapshot = self._loaded.get(snapshot_id)
            if snapshot is not None:
                self._loaded.move_to_end(snapshot_id)
            return snapshot

    def adapter_of(self, snapshot_id: str) -> str | None:
        """The id of the adapter the snapshot was taken from (None: none, or no such snapshot),
        without reading it back."""
        with self._lock:
            if snapshot_id in self._loaded:
                return self._loaded[snapshot_id].adapter_id
            spilled = self._spilled.get(snapshot_id)
            return None if spilled is None else spilled.adapter_id

    def orphan(self, snapshot_id: str) -> None:
        """The snapshot's adapter is gone; the snapshot stays."""
        with self._lock:
            if (s := self._loaded.get(snapshot_id)) is not None:
                self._loaded[snapshot_id] = Snapshot(None, s.base_model, s.weights)
            elif (p := self._spilled.get(snapshot_id)) is not None:
                self._spilled[snapshot_id] = _Spilled(None, p.base_model, p.path)

    def drop(self, snapshot_id: str) -> None:
        """Forget the snapshot (and delete its file); no-op if there is none of that id."""
        with self._lock:
            self._loaded.pop(snapshot_id, None)
            spilled = self._spilled.pop(snapshot_id, None)
            if spilled is not None:
                spilled.path.unlink(missing_ok=True)

    def _make_room(self, *, keep: str) -> None:
        """Page out the least recently used snapshots but `keep` beyond the limit."""
        if self.max_loaded is None:
            return
        excess = len(self._loaded) - self.max_loaded
        page_out([s for s in self._loaded if s != keep], excess, self._spill)

    def _spill(self, snapshot_id: str) -> bool:
        """Write the snapshot's tensors to its file (a temporary file renamed into place), then
        let them go. False, keeping it in memory, if the file cannot be written. A sample batch
        still decoding with it holds its tensors until that batch is done."""
        snapshot = self._loaded[snapshot_id]
        path = self._folder() / f"{next(self._names)}{SNAPSHOT_SUFFIX}"
        weights = snapshot.weights
        if not write_spill_file(
            path, _tensors(weights), f"snapshot {snapshot_id}", _metadata(weights)
        ):
            return False
        del self._loaded[snapshot_id]
        self._spilled[snapshot_id] = _Spilled(snapshot.adapter_id, snapshot.base_model, path)
        return True

    def _folder(self) -> Path:
        if self._spill_dir is None:
            self._spill_dir = Path(tempfile.mkdtemp(prefix="treadle-snapshots-"))
            weakref.finalize(self, shutil.rmtree, self._spill_dir, True)
        return self._spill_dir


def _tensors(weights: LoraWeights) -> dict[str, torch.Tensor]:
    """Every tensor on the CPU, keyed `A:<module>` / `B:<module>`."""
    out = {}
    for module in weights.A:
        out[f"A:{module}"] = weights.A[module].detach().to("cpu").contiguous()
        out[f"B:{module}"] = weights.B[module].detach().to("cpu").contiguous()
    return out


def _metadata(weights: LoraWeights) -> dict[str, str]:
    """What the file needs besides the tensors: the scale, exactly, and the modules' order."""
    return {"scale": repr(weights.scale), "modules": json.dumps(list(weights.A))}


def _read(path: Path, snapshot_id: str, device: torch.device) -> LoraWeights:
    """The weights `_spill` wrote, on `device`, their modules in the order they had."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            modules = json.loads(metadata["modules"])
            a = {m: owned(f.get_tensor(f"A:{m}")).to(device) for m in modules}
            b = {m: owned(f.get_tensor(f"B:{m}")).to(device) for m in modules}
        return LoraWeights(scale=float(metadata["scale"]), A=a, B=b)
    except Exception as exc:  # OSError, or safetensors' error for a damaged file
        raise UnavailableError(
            f"snapshot {snapshot_id!r} was paged out to {path} and cannot be read back ({exc}); "
            "retry: it is rebuilt from the session's log when next used"
        ) from exc
