"""A forward_backward's gradient is added in one tree fixed by its number of parts
(`treadle.engine.gradients`): cut into units that processes compute alone and put back
together, it is the same bit for bit at every world size; a running sum holds a logarithmic
number of buffers, never one per part; a group exchanges O(adapter) bytes, whatever the
number of parts (real gloo processes)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from treadle.engine.distributed.group import Group
from treadle.engine.gradients import PairwiseSum, combine, units_of
from treadle.engine.protocol import ALONE, Part

SIZE = 1000


def _terms(n: int, seed: int = 0) -> list[torch.Tensor]:
    """Float32 terms of very different magnitudes, so that the order of the additions shows in
    the bits of the sum."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(SIZE, generator=g) * 10.0 ** torch.randint(-6, 6, (SIZE,), generator=g)
        for _ in range(n)
    ]


def _tree(terms: list[torch.Tensor]) -> torch.Tensor:
    """The canonical tree, written out independently: aligned power-of-two blocks, largest
    first, each a perfect binary tree, the blocks added left to right."""

    def perfect(block: list[torch.Tensor]) -> torch.Tensor:
        if len(block) == 1:
            return block[0].clone()
        half = len(block) // 2
        return perfect(block[:half]) + perfect(block[half:])

    sums, start = [], 0
    for bit in reversed(range(len(terms).bit_length())):
        if len(terms) >> bit & 1:
            sums.append(perfect(terms[start : start + (1 << bit)]))
            start += 1 << bit
    total = sums[0]
    for block in sums[1:]:
        total = total + block
    return total


def _unit_sums(terms: list[torch.Tensor], units: list[range]) -> list[torch.Tensor]:
    """Each unit's sum, as the process computing it keeps it: one running sum per unit."""
    sums = []
    for unit in units:
        running = PairwiseSum()
        for p in unit:
            running.push(terms[p].clone())
        total = running.total()
        assert total is not None
        sums.append(total)
    return sums


def _by_units(terms: list[torch.Tensor], world_size: int) -> torch.Tensor:
    units = units_of(len(terms), world_size)
    gradient = combine(dict(enumerate(_unit_sums(terms, units))), units)
    assert gradient is not None
    return gradient


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 31, 64])
def test_the_sum_is_the_canonical_tree_at_every_world_size(n: int) -> None:
    terms = _terms(n)
    expected = _tree(terms)
    for world_size in (1, 2, 3, 4, 8):
        assert torch.equal(_by_units(terms, world_size), expected), (n, world_size)
    if n >= 5:  # the order matters for these terms: a plain left fold gives other bits
        fold = terms[0].clone()
        for term in terms[1:]:
            fold = fold + term
        assert not torch.equal(fold, expected)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_units_are_whole_subtrees_about_two_per_rank(world_size: int) -> None:
    for n in range(0, 70):
        units = units_of(n, world_size)
        assert [p for unit in units for p in unit] == list(range(n))
        assert all(len(u) & (len(u) - 1) == 0 and u.start % len(u) == 0 for u in units)
        assert len(units) <= max(2 * world_size, n.bit_count())


def test_a_running_sum_holds_a_logarithmic_number_of_buffers() -> None:
    running, most = PairwiseSum(), 0
    for term in _terms(64):
        running.push(term)
        most = max(most, running.held)
    assert most <= 7  # log2(64) + 1; a sum kept per part would hold 64
    assert running.held == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(
    rank: int, world_size: int, port: int, sizes: tuple[int, ...], out: dict[object, object]
) -> None:
    """One rank of the group: an exchange of `n` parts for each n of `sizes`, in one process
    group (a process each rank, spawned once)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        group = Group(rank, world_size, 60.0)
        for n in sizes:
            terms = _terms(n)
            units = group.units(n)
            mine: dict[int, Part] = {}
            for p, kept in group.passes([100] * n):
                assert kept
                mine[p] = Part([], float(p))
            sums = {
                u: total
                for u, (unit, total) in enumerate(zip(units, _unit_sums(terms, units), strict=True))
                if unit.start in mine
            }
            before = group.exchanged.gradient_bytes
            parts, gradient = group.exchange(mine, sums, units)
            assert [part.loss for part in parts] == [float(p) for p in range(n)]
            assert gradient is not None
            out[rank, n] = (gradient.clone(), group.exchanged.gradient_bytes - before)
    finally:
        dist.destroy_process_group()


def _world(world_size: int, sizes: tuple[int, ...]) -> dict[object, object]:
    out: dict[object, object] = mp.Manager().dict()
    mp.spawn(_rank, args=(world_size, _free_port(), sizes, out), nprocs=world_size)
    return dict(out)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_group_adds_the_same_bits_and_moves_the_adapter_a_few_times(world_size: int) -> None:
    sizes = (1, 16, 64)
    ranks = _world(world_size, sizes)
    for n in sizes:
        expected = _tree(_terms(n))
        alone = ALONE.exchange(
            {p: Part([], float(p)) for p in range(n)},
            {u: t.clone() for u, t in enumerate(_unit_sums(_terms(n), ALONE.units(n)))},
            ALONE.units(n),
        )[1]
        assert alone is not None and torch.equal(alone, expected)
        for rank in range(world_size):
            gradient, received = ranks[rank, n]  # type: ignore[misc]
            assert torch.equal(gradient, expected), (n, world_size, rank)
            # the adapter's bytes a few times over (this rank's slice of every unit, then
            # every slice), not once per part
            assert received <= 4 * SIZE * 4, (n, received)
