"""A sharded group's embeddings and output head, split by vocabulary rows like its layers.

Owns `shard_vocabulary` (a model's input embedding and output head, a plain `nn.Embedding` and
a bias-free `nn.Linear`, replaced in place by `ShardedEmbedding` and `ShardedHead` over one
`VocabRows` each), those modules, and `VocabRows`: of a [V, H] weight, rank r of the shard group
keeps rows [r*S, (r+1)*S) (S = V / ranks, rounded up; the last rank's tail is zeros), and
gathers the rest when used:
- a lookup a piece at a time (each rank's next S/PIECES rows, all-gathered, copied where the ids
  fall, freed), so it never holds more than its rows and one piece;
- the output head whole, for one chunk's forward and again for its backward (the grad of its
  input, dx = dy @ W; the weight is frozen), freed after each: the very products one process
  computes. Products over pieces of the weight would need less, but a narrower matrix may take
  another kernel whose sums round differently (seen on this CPU for some widths), and a sharded
  group must compute what one process does, bit for bit (tests/unit/engine/test_worker_group.py),
  so that a session moves between workers of any layout and replays as `matched`.

A tied embedding and head (one weight, a fraction e of the model) stays whole on every rank:
sharded, the head's use would gather it whole beside the rank's own rows, raising the peak to
about 1/2 + e of the model at two ranks (0.71 of SmolLM2, e = 0.21: measured with
`benchmarks/sharded_residency.py`) where whole it is 1/2 + e/2 plus the layers FSDP holds
gathered. Models big enough to need sharding untie them (Llama 3.1 8B and 70B, Qwen3 8B and up).

Collectives: every use is a fixed sequence of all-gathers on the shard group whose data is the
weight's, whatever the input, so the ranks must make the same uses in the same order. A
sampling step is the same batch on every rank; a training pass plans its output-head chunks
for the group's largest pass (`losses.functions.batch_loss`'s `plan_tokens`), a smaller pass
running empty ones. The gathers cost the weight's bytes once per use (a lookup, each head
chunk's forward, and again in its backward), like a decoder layer's FSDP gathers: traffic paid
to hold a shard between uses.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from treadle.engine.models.vocab_split import split_by_rows
from treadle.engine.protocol import WeightSource

__all__ = ["PIECES", "ShardedEmbedding", "ShardedHead", "VocabRows", "shard_vocabulary"]

Tensor = torch.Tensor

# Pieces a lookup gathers the weight in: each about 1/PIECES of it beyond the rank's own rows.
PIECES = 8


class VocabRows:
    """This rank's rows of a [vocab, hidden] weight split across `group`, and the gathers that
    bring the rest a piece at a time."""

    def __init__(self, local: Tensor, vocab: int, group: Any) -> None:
        self.group = group
        self.ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.vocab, self.hidden = vocab, local.shape[1]
        self.per_rank = math.ceil(vocab / self.ranks)
        self.row_spans = _spans(self.per_rank)
        if local.shape[0] != self.per_rank:
            raise ValueError(f"rank {self.rank} holds {local.shape[0]} rows, not {self.per_rank}")
        # A parameter, so that moving the model's parameters to its device moves these too.
        self.weight = nn.Parameter(local, requires_grad=False)

    @staticmethod
    def span(vocab: int, ranks: int, rank: int) -> tuple[int, int]:
        """The rows [lo, hi) of a `vocab`-row weight that `rank` of `ranks` keeps (hi may pass
        the vocabulary: the tail is zeros)."""
        per_rank = math.ceil(vocab / ranks)
        return rank * per_rank, (rank + 1) * per_rank

    def row_pieces(self) -> Iterator[tuple[Tensor, list[tuple[int, int, int]]]]:
        """Each piece of rows in turn, gathered: the [ranks x rows, hidden] tensor and, per
        rank's block, (its first row in the tensor, its first vocabulary row, its rows)."""
        for start, rows in self.row_spans:
            mine = self.weight[start : start + rows]
            gathered = mine.new_empty(self.ranks * rows, self.hidden)
            dist.all_gather_into_tensor(gathered, mine.contiguous(), group=self.group)
            blocks = []
            for r in range(self.ranks):
                first = r * self.per_rank + start
                blocks.append((r * rows, first, max(0, min(rows, self.vocab - first))))
            yield gathered, blocks
            del gathered

    def whole(self) -> Tensor:
        """The whole [vocab, hidden] weight, gathered (the caller frees it)."""
        gathered = self.weight.new_empty(self.ranks * self.per_rank, self.hidden)
        dist.all_gather_into_tensor(gathered, self.weight.detach(), group=self.group)
        return gathered[: self.vocab]


class ShardedEmbedding(nn.Module):
    """`nn.Embedding`'s lookup (no gradient: the base weight is frozen) from `VocabRows`."""

    def __init__(self, rows: VocabRows) -> None:
        super().__init__()
        self.vocab_rows = rows
        self.rows = rows.weight
        self.num_embeddings, self.embedding_dim = rows.vocab, rows.hidden

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        out = self.vocab_rows.weight.new_zeros(flat.numel(), self.embedding_dim)
        for gathered, blocks in self.vocab_rows.row_pieces():
            for at, first, count in blocks:
                hit = (flat >= first) & (flat < first + count)
                out[hit] = gathered[at + flat[hit] - first]
        return out.view(*ids.shape, self.embedding_dim)


class ShardedHead(nn.Module):
    """A bias-free `nn.Linear` to the vocabulary (`x @ W.T`) from `VocabRows`, with the grad
    of its input, the weight gathered whole for each."""

    def __init__(self, rows: VocabRows) -> None:
        super().__init__()
        self.vocab_rows = rows
        self.rows = rows.weight
        self.in_features, self.out_features = rows.hidden, rows.vocab
        self.bias = None

    def forward(self, x: Tensor) -> Tensor:
        return _Head.apply(x, self.vocab_rows)  # type: ignore[no-any-return]


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, rows: VocabRows) -> Tensor:  # type: ignore[override]
        ctx.rows = rows
        weight = rows.whole()
        return F.linear(x, weight)  # nn.Linear's own product

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        rows: VocabRows = ctx.rows
        weight = rows.whole()  # again: kept from the forward, it would stay whole till now
        grad_N_V = grad.reshape(-1, rows.vocab)
        return grad_N_V.mm(weight).view(*grad.shape[:-1], rows.hidden), None  # linear's backward


def shard_vocabulary(
    model: nn.Module, group: Any, files: WeightSource | None
) -> list[nn.Parameter]:
    """Replace `model`'s input embedding and output head (those `split_by_rows` names: plain,
    and not tied) with sharded ones over `group`, in place, wherever the model holds them (a
    LoRA wrapper's `base` included); a weight still on the meta device reads only this rank's
    rows from `files`. Returns the parameters now holding this rank's rows (none: the model
    keeps them whole)."""
    embedding, head = split_by_rows(model)
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    replaced: dict[int, nn.Module] = {}
    held: list[VocabRows] = []
    if embedding is not None:
        rows = VocabRows(
            _rows(embedding.weight, ranks, rank, files), embedding.num_embeddings, group
        )
        replaced[id(embedding)] = ShardedEmbedding(rows)
        held.append(rows)
    if head is not None:
        rows = VocabRows(_rows(head.weight, ranks, rank, files), head.out_features, group)
        replaced[id(head)] = ShardedHead(rows)
        held.append(rows)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in replaced:
                setattr(parent, name, replaced[id(child)])
    return [rows.weight for rows in held]


def _spans(total: int) -> list[tuple[int, int]]:
    """[0, total) cut into at most PIECES runs (start, length) of nearly equal length."""
    count = max(1, min(PIECES, total))
    base, extra = divmod(total, count)
    lengths = [base + 1] * extra + [base] * (count - extra)
    starts = [sum(lengths[:i]) for i in range(count)]
    return list(zip(starts, lengths, strict=True))


def _rows(weight: Tensor, ranks: int, rank: int, files: WeightSource | None) -> Tensor:
    """This rank's rows of `weight`, padded with zero rows to its share: read from `files`
    when the weight is still on the meta device, else copied out of it."""
    vocab, hidden = weight.shape
    lo, hi = VocabRows.span(vocab, ranks, rank)
    end = max(lo, min(hi, vocab))
    if weight.is_meta:
        assert files is not None, "a meta weight needs its files"
        mine = files.rows(weight, lo, end)
    else:
        mine = weight.detach()[lo:end].clone()
    if end - lo < hi - lo:
        mine = torch.cat([mine, mine.new_zeros(hi - end, hidden)])
    return mine.contiguous()
