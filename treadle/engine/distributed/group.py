"""Worker groups: one engine per rank of a `torch.distributed` process group, driven by rank 0.

Owns a rank's place in its group (`Group`: rank, world size, the collectives' timeout, the
layout of the base models), joining and leaving the process group, the collectives the group
runs on (every one bounded by the group's timeout: a rank that dies fails the others within it
instead of hanging them), the exact data parallelism of `forward_backward` and the sharding of a
base model. How rank 0 drives the others lives in `executor`, sampling on a group in
`decoding`.

Data parallel, exact: `forward_backward` splits a request into parts the same way at every world
size (`losses.microbatches`) and adds their gradients in one tree fixed by their number
(`gradients`); each rank computes whole units of that tree (`Group.assign`, balanced by tokens),
keeping one running sum per unit, and `Group.exchange` hands every rank every part's outputs and
loss (gathered objects) and the request's gradient: an all-to-all of the units' sums by slices
and an all-gather of the added slices (tensor collectives, O(adapter) bytes per rank whatever the
number of parts). The tree fixes every rounding, so adapters, optimizer states and their hashes
are the same bit for bit at every world size.

Layouts: `replicated` (every rank holds the whole base model) or `sharded` (`shard_layers`: each
decoder layer's frozen weights split across the ranks with FSDP2's `fully_shard` over a
`DeviceMesh`, read a layer at a time, gathered layer by layer for each pass; the embeddings and
output head split by vocabulary rows (`vocabulary`), gathered a piece at a time; the final norm
whole on every rank; a group on several hosts shards within each host, hybrid). A sharded forward pass is a collective: every rank runs as many
passes as the others (`Group.passes`), and samples are decoded on every rank in lockstep.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from treadle.engine.distributed.vocabulary import shard_vocabulary
from treadle.engine.gradients import combine, units_of
from treadle.engine.memory.heap import release_excess
from treadle.engine.protocol import Part, Topology, WeightSource
from treadle.platform.config import GROUP_LAYOUTS as LAYOUTS

__all__ = [
    "GROUP_FAILED_EXIT",
    "LAYOUTS",
    "Group",
    "broadcast",
    "fail",
    "gather",
    "init_from_env",
    "leave",
    "shard_layers",
]

log = logging.getLogger(__name__)

# A rank's exit status when its group failed (a rank died, a collective timed out, the ranks
# disagreed): its launcher ends the other ranks and the worker is started again.
GROUP_FAILED_EXIT = 75


@dataclass
class CollectiveTime:
    """What this rank spent in forward_backward's exchanges: time (waiting for the others
    included), and the bytes its gradient's tensor collectives received."""

    seconds: float = 0.0
    calls: int = 0
    gradient_bytes: int = 0


@dataclass(frozen=True)
class Group:
    """This process's place in the group: its rank, the world size, the collectives' timeout
    and the base models' layout (one of LAYOUTS)."""

    rank: int
    world_size: int
    timeout_seconds: float
    layout: str = "replicated"
    node_size: int = 0  # ranks per host (torchrun's LOCAL_WORLD_SIZE); 0: every rank on one
    exchanged: CollectiveTime = field(default_factory=CollectiveTime, compare=False)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; use one of {', '.join(LAYOUTS)}")
        if self.node_size and (self.node_size < 1 or self.world_size % self.node_size):
            raise ValueError(
                f"{self.world_size} ranks cannot be split into hosts of {self.node_size}; start "
                "the same number of ranks on every host"
            )

    @property
    def topology(self) -> Topology:
        return Topology(self.world_size, self.layout, self.timeout_seconds, self.node_size)

    @property
    def hosts(self) -> int:
        """How many hosts the group spans (1 unless `node_size` says otherwise)."""
        return self.world_size // self.node_size if self.node_size else 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.layout == "sharded"

    def units(self, count: int) -> list[range]:
        """See `gradients.units_of`: about two units per rank."""
        return units_of(count, self.world_size)

    def assign(self, tokens_P: Sequence[int]) -> list[int]:
        """The parts this rank computes: whole units, each unit, largest first, to the rank
        with the fewest tokens so far (ties to the lowest rank). The same on every rank."""
        return [p for p, r in enumerate(self.owners(tokens_P)) if r == self.rank]

    def owners(self, tokens_P: Sequence[int]) -> list[int]:
        """Each part's rank: its unit's (see `assign`)."""
        units = self.units(len(tokens_P))
        owner = [0] * len(tokens_P)
        for u, rank in enumerate(self._unit_owners(tokens_P, units)):
            for p in units[u]:
                owner[p] = rank
        return owner

    def _unit_owners(self, tokens_P: Sequence[int], units: Sequence[range]) -> list[int]:
        load = [0] * self.world_size
        owner = [0] * len(units)
        size = [sum(tokens_P[p] for p in unit) for unit in units]
        for u in sorted(range(len(units)), key=lambda u: (-size[u], u)):
            rank = min(range(self.world_size), key=lambda r: (load[r], r))
            owner[u] = rank
            load[rank] += size[u]
        return owner

    def passes(self, tokens_P: Sequence[int]) -> list[tuple[int, bool]]:
        """The passes this rank runs: its parts, each with True; in the sharded layout, where
        every pass is a collective, as many as the rank with the most, the extra ones (False:
        computed, then dropped) on the request's smallest part."""
        owners = self.owners(tokens_P)
        mine = [(p, True) for p, r in enumerate(owners) if r == self.rank]
        if not self.sharded or not tokens_P:
            return mine
        most = max(owners.count(r) for r in range(self.world_size))
        smallest = min(range(len(tokens_P)), key=lambda p: (tokens_P[p], p))
        return mine + [(smallest, False)] * (most - len(mine))

    def shard(self, model: nn.Module, device: torch.device, files: WeightSource | None) -> int:
        """See `shard_layers`."""
        return shard_layers(model, self, device, files)

    def exchange(
        self, mine: dict[int, Part], sums: dict[int, torch.Tensor], units: Sequence[range]
    ) -> tuple[list[Part], torch.Tensor | None]:
        """Every part's outputs and loss, in order, on every rank (gathered objects: O(tokens)),
        and the request's gradient from the units' sums (`_gradient`: O(adapter) bytes)."""
        started = time.perf_counter()
        numel = next((s.numel() for s in sums.values()), 0)
        gathered = gather((mine, sorted(sums), numel), "forward_backward's exchange")
        every: dict[int, Part] = {}
        for parts, _, _ in gathered:
            every.update(parts)
        count = sum(len(unit) for unit in units)
        assert sorted(every) == list(range(count)), (sorted(every), count)
        owned = [theirs for _, theirs, _ in gathered]
        numel = max(n for _, _, n in gathered)
        gradient = None if numel == 0 else self._gradient(sums, owned, units, numel)
        self.exchanged.seconds += time.perf_counter() - started
        self.exchanged.calls += 1
        return [every[p] for p in range(count)], gradient

    def _gradient(
        self,
        sums: dict[int, torch.Tensor],
        owned: list[list[int]],
        units: Sequence[range],
        numel: int,
    ) -> torch.Tensor:
        """The units' sums added in the canonical tree, each rank adding one slice of every
        flat buffer: an all-to-all hands rank r slice r of every unit's sum (about two units
        per rank, so about 2/world of the adapter), it adds them (`gradients.combine`), and an
        all-gather hands every rank every slice. Addition is elementwise, so the slices'
        sums are the whole buffer's, bit for bit."""
        world = self.world_size
        width = -(-numel // world)  # each rank's slice, the last one padded
        device = next(iter(sums.values())).device if sums else self._device()
        padded = torch.zeros(len(owned[self.rank]), world * width, device=device)
        for i, u in enumerate(owned[self.rank]):
            padded[i, :numel] = sums[u]
        send = padded.view(-1, world, width).transpose(0, 1).contiguous().view(-1)
        received = torch.empty(sum(len(o) for o in owned) * width, device=device)
        _collective(
            "forward_backward's gradient exchange",
            lambda: dist.all_to_all_single(
                received,
                send,
                output_split_sizes=[len(o) * width for o in owned],
                input_split_sizes=[len(owned[self.rank]) * width] * world,
            ),
        )
        slices = dict(
            zip(
                (u for o in owned for u in o),
                received.view(-1, width).unbind(),
                strict=True,
            )
        )
        mine = combine(slices, units)
        assert mine is not None, "a request with a gradient has units"
        every = [torch.empty(width, device=device) for _ in range(world)]
        _collective("forward_backward's gradient exchange", lambda: dist.all_gather(every, mine))
        self.exchanged.gradient_bytes += 4 * (received.numel() + world * width)
        return torch.cat(every)[:numel]

    def _device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def init_from_env(
    timeout_seconds: float, device: str | None = None, layout: str = "replicated"
) -> Group:
    """Join the process group torchrun's environment describes (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT; LOCAL_WORLD_SIZE, the ranks on each host): NCCL on CUDA, gloo on the CPU,
    every collective bounded by `timeout_seconds`."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    node_size = 0 if node_size == world_size else node_size
    group = Group(rank, world_size, timeout_seconds, layout, node_size)  # ValueError: bad layout
    on_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        backend="nccl" if on_cuda else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_seconds),
    )
    return group


def shard_layers(
    model: nn.Module, group: Group, device: torch.device, files: WeightSource | None = None
) -> int:
    """Split each decoder layer's weights (the backbone's `layers`) across the group's ranks with
    FSDP2's `fully_shard` on a one-dimensional `DeviceMesh`, the backbone their root (on a group
    spanning several hosts, a two-dimensional one: hybrid sharding, each host's ranks sharding
    a whole copy among themselves, so a layer's gather never leaves the host); each pass
    gathers a layer's weights just before it runs and frees them after. The embeddings and
    output head are split by vocabulary rows (`vocabulary.shard_vocabulary`), the final norm
    stays whole.
    `model` may be in host memory, or have its parameters on the meta device with `files` to
    read them from: each layer is read whole into host memory just before FSDP shards it (so a
    rank holds at most one whole layer beyond its shards while loading), FSDP moves its shard to
    `device`, and the rest follows, so neither the host nor the device ever holds the whole
    model. Returns the number of layers sharded (0: a model without a `layers` list runs whole,
    and is moved to `device`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        if files is not None:
            files.materialize(model)
        _to_device(model, device, skip=set())
        return 0
    if group.hosts > 1:  # hybrid: each host holds a whole copy, sharded across its ranks
        mesh = init_device_mesh(
            device.type, (group.hosts, group.node_size), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device.type, (group.world_size,))
    for layer in layers:
        if files is not None:
            files.materialize(layer)
        fully_shard(layer, mesh=mesh)  # keeps a copy of this rank's shard; the layer read goes
        release_excess(keep=0)  # its pages too, or the C heap keeps them
    # The embeddings and output head by vocabulary rows (this rank's read alone), gathered a
    # piece at a time when used (`vocabulary`); on a hybrid group, within each host.
    shard_group = mesh.get_group("shard") if group.hosts > 1 else mesh.get_group()
    shard_vocabulary(model, shard_group, files)
    if files is not None:
        files.materialize(model)  # the rest (the final norm, an embedding kept whole)
    in_layers = {id(t) for t in itertools.chain(layers.parameters(), layers.buffers())}
    # The backbone is the root (sharding nothing of its own: its final norm stays whole and
    # its embeddings are sharded by `vocabulary`), so that each layer is not one: FSDP keeps a
    # root's weights gathered after its forward (its backward would gather them at once), and
    # with every layer its own root a forward or a sample left the whole model gathered on
    # every rank.
    rest = {p for p in decoder.parameters() if id(p) not in in_layers}
    fully_shard(decoder, mesh=mesh, ignored_params=rest)
    _to_device(model, device, skip=in_layers)
    # Gather each layer once now, outside any inference mode: FSDP keeps the gathered weights'
    # tensors for later passes, and ones first made under sampling's `inference_mode` could
    # not be used by a training pass.
    with torch.no_grad():
        for layer in layers:
            layer.unshard()  # type: ignore[operator]
            layer.reshard()  # type: ignore[operator]
            release_excess(keep=0)
    return len(layers)


def _to_device(model: nn.Module, device: torch.device, skip: set[int]) -> None:
    """Move `model`'s tensors but those in `skip` to `device`, in place: a weight two modules
    share (tied embeddings) stays one tensor."""
    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and id(param) not in skip and param.device != device:
                    param.data = param.data.to(device)
            for name, buffer in module._buffers.items():
                if buffer is not None and id(buffer) not in skip and buffer.device != device:
                    module._buffers[name] = buffer.to(device)


def broadcast(message: Any) -> Any:
    """Rank 0's `message` on every rank (the others pass None)."""
    box: list[Any] = [message]
    _collective("broadcast", lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def gather(mine: Any, what: str = "all_gather_object") -> list[Any]:
    """Every rank's object, by rank, on every rank."""
    every: list[Any] = [None] * dist.get_world_size()
    _collective(what, lambda: dist.all_gather_object(every, mine))
    return every


def _collective(what: str, run: Callable[[], Any]) -> Any:
    """Run a collective; if the group failed (a rank died, the timeout passed), end this rank
    at once: its operation stays pending in the log, and the next group rebuilds the session."""
    try:
        return run()
    except RuntimeError as exc:
        fail(f"the worker group failed in {what} ({exc})")


def fail(why: str) -> None:
    """End this rank with GROUP_FAILED_EXIT, logging `why`: its launcher ends the others."""
    log.critical("%s; ending rank %d", why, dist.get_rank() if dist.is_initialized() else -1)
    logging.shutdown()
    os._exit(GROUP_FAILED_EXIT)


def leave(engine: Any = None) -> None:
    """Leave the process group (after rank 0 closed it), then unload `engine`'s base models
    while the interpreter is whole: a sharded model's tensors hold the process group, and
    left to the interpreter's teardown they ended a rank with SIGABRT ("terminate called
    without an active exception") about one time in three."""
    if dist.is_initialized():
        _collective("barrier", dist.barrier)
        dist.destroy_process_group()
    if engine is not None:
        engine.unload()
        gc.collect()
