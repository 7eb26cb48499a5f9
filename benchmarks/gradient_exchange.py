"""Bytes a rank receives to sum one forward_backward's gradient in a worker group, as the number
of parts grows: the tensor exchange (`Group.exchange`: an all-to-all of the units' sums by slices,
then an all-gather of the added slices) against gathering every part's gradient as pickled
objects (`all_gather_object`, what the group did before).

Real gloo processes (one per rank) exchange random flat gradients of `--numel` float32 values
(SmolLM2-135M's LoRA at rank 32 on every attention and MLP linear is 11.3 M); both ways are
measured in the same run: the tensor exchange's count is `CollectiveTime.gradient_bytes`, the
objects' is the pickled size of what each rank receives. The summed gradients are checked equal,
bit for bit, to a single process's.

    python benchmarks/gradient_exchange.py [--world-size 2] [--parts 4 16 64] [--numel 1000000]
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from treadle.engine.distributed.group import Group  # noqa: E402
from treadle.engine.gradients import PairwiseSum, combine  # noqa: E402
from treadle.engine.protocol import Part  # noqa: E402

MIB = 2**20


def _terms(n: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(numel, generator=g) for _ in range(n)]


def _unit_sum(terms: list[torch.Tensor], unit: range) -> torch.Tensor:
    running = PairwiseSum()
    for p in unit:
        running.push(terms[p].clone())
    total = running.total()
    assert total is not None
    return total


def _rank(rank: int, world: int, port: int, parts: list[int], numel: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for n in parts:
            group = Group(rank, world, 600.0)
            terms = _terms(n, numel)
            units = group.units(n)
            mine = {p: Part([], 0.0) for p, _ in group.passes([1] * n)}
            sums = {u: _unit_sum(terms, unit) for u, unit in enumerate(units) if unit.start in mine}
            started = time.perf_counter()
            _, gradient = group.exchange(mine, sums, units)
            tensor_s = time.perf_counter() - started
            assert gradient is not None
            expected = combine({u: _unit_sum(terms, unit) for u, unit in enumerate(units)}, units)
            assert expected is not None and torch.equal(gradient, expected)
            # before: every part's gradient, as objects, to every rank
            every: list[object] = [None] * world
            started = time.perf_counter()
            dist.all_gather_object(every, {p: terms[p] for p in mine})
            objects_s = time.perf_counter() - started
            received = sum(len(pickle.dumps(g)) for r, g in enumerate(every) if r != rank)
            out[rank, n] = (group.exchanged.gradient_bytes, tensor_s, received, objects_s)
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--parts", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--numel", type=int, default=1_000_000)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out: dict = mp.Manager().dict()
    mp.spawn(
        _rank, args=(args.world_size, port, args.parts, args.numel, out), nprocs=args.world_size
    )
    adapter = 4 * args.numel
    print(f"adapter {adapter / MIB:.1f} MiB, world size {args.world_size}; per rank and step:")
    for n in args.parts:
        for rank in range(args.world_size):
            tensor, tensor_s, objects, objects_s = out[rank, n]
            print(
                f"  {n:3d} parts, rank {rank}: tensor exchange {tensor / MIB:8.1f} MiB "
                f"({tensor / adapter:.2f} adapters, {tensor_s:.3f} s); objects "
                f"{objects / MIB:8.1f} MiB ({objects / adapter:.2f} adapters, {objects_s:.3f} s)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
