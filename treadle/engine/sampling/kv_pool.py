"""The sampler's KV cache: a budget of token slots, allocated once, shared by a batch's rows.

Owns `KvPool`: per attention layer one keys and one values tensor of `tokens` slots (plus one
slot of zeros that padding reads), allocated when the layer first runs and never grown or
copied; the budget's bookkeeping (a job reserves the most slots it can use before it joins, and
gives them back when it leaves; one larger than the whole budget runs alone in a pool of its
own size, `resize`) and the slots themselves (each token written once, into a free
slot). `PooledCache` is the transformers `Cache` over it: a prefill writes each prompt token into
its slot and attends to the prompt as computed; a decoding step writes each row's new token into
its slot and gathers every row's tokens (its prompt's slots, read by all of the prompt's
samples, then its own) into one left-padded [rows, heads, columns, dim] view, one layer at a
time, for the attention. Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["KvPool", "Plan", "PooledCache", "kv_need"]


def kv_need(prompt_tokens: int, num_samples: int, max_tokens: int) -> int:
    """The most KV slots a request holds: its prompt's tokens once (its samples share them),
    and each sample's tokens but the last (the last drawn is never fed back)."""
    return prompt_tokens + num_samples * max(max_tokens - 1, 0)


@dataclass(frozen=True)
class Plan:
    """What the next forward pass writes and reads. `past`: the columns before the query's
    (0 for a prefill). `dst`: the slot of each token written, in the order `src` picks them
    from the pass's keys flattened to [rows x columns] (a prefill), or one per row (a step,
    `src` None). `read_R_L`: a step's view, each row's slots right-aligned and left-padded
    with the pool's zero slot (None: a prefill, which attends to its own keys)."""

    past: int
    dst: torch.Tensor
    src: torch.Tensor | None = None
    read_R_L: torch.Tensor | None = None


class KvPool:
    """`tokens` slots of KV cache for each attention layer of a model with `layers` layers."""

    def __init__(self, tokens: int, layers: int) -> None:
        assert tokens >= 0, tokens
        self.budget = tokens
        self.reserved = 0  # slots promised to the jobs in the batch (at most `tokens`)
        self.peak = 0  # the most slots holding tokens at once
        self.plan = Plan(past=0, dst=torch.empty(0, dtype=torch.long))
        self.layers = [_PooledLayer(self) for _ in range(layers)]
        self.resize(tokens)

    def resize(self, tokens: int) -> None:
        """Hold `tokens` slots from now on (the pool empty: a job larger than the whole budget
        runs alone in a pool of its own size, and the budget's comes back after it)."""
        assert self.reserved == 0, self.reserved
        self.tokens = tokens
        self.pad = tokens  # the slot of zeros: left padding reads it (never garbage, never NaN)
        self._free = list(range(tokens - 1, -1, -1))  # `take` hands out the lowest first
        for layer in self.layers:
            layer.reset()

    @property
    def in_use(self) -> int:
        """Slots holding a token now."""
        return self.tokens - len(self._free)

    def fits(self, need: int) -> bool:
        return self.reserved + need <= self.tokens

    def reserve(self, need: int) -> None:
        assert self.fits(need), (self.reserved, need, self.tokens)
        self.reserved += need

    def release(self, need: int) -> None:
        self.reserved -= need
        assert self.reserved >= 0, self.reserved

    def take(self, n: int) -> list[int]:
        """`n` free slots (the reservations guarantee there are)."""
        assert n <= len(self._free), (n, len(self._free))
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        self.peak = max(self.peak, self.in_use)
        return taken

    def give(self, slots: list[int]) -> None:
        """`slots` are free again (their tokens' job left)."""
        self._free.extend(slots)

    def nbytes(self) -> int:
        """Bytes the layers allocated so far (keys, values and their zero slot)."""
        return sum(layer.nbytes() for layer in self.layers)


class PooledCache(Cache):
    """The transformers cache over `pool` (see the module docstring)."""

    def __init__(self, pool: KvPool) -> None:
        super().__init__(layers=list(pool.layers))


class _PooledLayer(CacheLayerMixin):
    """One attention layer's slots: keys [tokens + 1, kv heads, head dim], values likewise."""

    is_sliding = False  # masks come from the model's layer types over the gathered columns

    def __init__(self, pool: KvPool) -> None:
        super().__init__()
        self._pool = pool

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots = self._pool.tokens + 1
        _, heads, _, key_dim = key_states.shape
        self.device = key_states.device
        # empty, not zeros: only written slots are read (padding reads the zero slot), and on
        # the CPU a freshly mapped page becomes resident only once a token is written into it
        self.keys = key_states.new_empty(slots, heads, key_dim)
        self.values = value_states.new_empty(slots, value_states.shape[1], value_states.shape[3])
        self.keys[self._pool.pad] = 0
        self.values[self._pool.pad] = 0
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        plan = self._pool.plan
        if plan.read_R_L is None:  # a prefill: its prompt tokens into their slots
            assert plan.src is not None
            for pool, states in ((keys, key_states), (values, value_states)):
                flat = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])
                pool.index_copy_(0, plan.dst, flat.index_select(0, plan.src))
            return key_states, value_states
        keys.index_copy_(0, plan.dst, key_states[:, :, -1])
        values.index_copy_(0, plan.dst, value_states[:, :, -1])
        rows, columns = plan.read_R_L.shape
        flat = plan.read_R_L.reshape(-1)
        return (
            keys.index_select(0, flat).view(rows, columns, *keys.shape[1:]).transpose(1, 2),
            values.index_select(0, flat).view(rows, columns, *values.shape[1:]).transpose(1, 2),
        )

    def reset(self) -> None:
        """Drop the slots (allocated again, at the pool's size, when the layer next runs)."""
        self.keys = self.values = None
        self.is_initialized = False

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._pool.plan.past + query_length, 0

    def get_seq_length(self) -> int:
        return self._pool.plan.past

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        if not self.is_initialized or self.keys is None or self.values is None:
            return 0
        return int(self.keys.nbytes + self.values.nbytes)
