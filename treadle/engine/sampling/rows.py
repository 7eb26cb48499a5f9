"""The rows of a decoding batch: one per sample, what each step computes and reads.

Owns `Rows`: each row's next-token logits, its attention mask and the pool slot it reads in
each column (both left-padded to the batch's width), its next position and its adapter; rows
are selected (those that go on, the all-padding columns cropped) and merged (a joining group's
rows after the running ones), index tensors only: the keys and values stay in their slots
(`kv_pool`). Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treadle.engine.lora.adapters import RowAdapters

__all__ = ["Rows", "pad_left"]


@dataclass
class Rows:
    """The decoding rows: the logits of each row's next token, the attention mask [R, L] (0 on
    left padding), the pool slot of each row's token in each column [R, L] (the zero slot on
    left padding), each row's next position and adapter."""

    logits_R_V: torch.Tensor
    mask_R_L: torch.Tensor
    read_R_L: torch.Tensor
    next_R: torch.Tensor
    adapters: RowAdapters
    # a vision-language model's: each row's multimodal position is next_R + rope_R (its
    # prompt's images take fewer positions than tokens); None for a text-only model
    rope_R: torch.Tensor | None = None

    def selected(self, keep_R: torch.Tensor) -> Rows:
        """Only the rows `keep_R`, with the columns that are padding in all of them cropped."""
        mask_R_L = self.mask_R_L[keep_R]
        read_R_L = self.read_R_L[keep_R]
        lead = int((mask_R_L.sum(dim=0) == 0).long().cumprod(dim=0).sum().item())
        return Rows(
            logits_R_V=self.logits_R_V[keep_R],
            mask_R_L=mask_R_L[:, lead:],
            read_R_L=read_R_L[:, lead:],
            next_R=self.next_R[keep_R],
            adapters=self.adapters.selected(keep_R.tolist()),
            rope_R=None if self.rope_R is None else self.rope_R[keep_R],
        )

    def merged(self, other: Rows, pad: int) -> Rows:
        """These rows and then `other`'s, both left-padded to the longer of the two (`pad`:
        the pool's zero slot)."""
        width = max(self.mask_R_L.shape[1], other.mask_R_L.shape[1])
        return Rows(
            logits_R_V=torch.cat([self.logits_R_V, other.logits_R_V]),
            mask_R_L=torch.cat(
                [pad_left(self.mask_R_L, width, 0), pad_left(other.mask_R_L, width, 0)]
            ),
            read_R_L=torch.cat(
                [pad_left(self.read_R_L, width, pad), pad_left(other.read_R_L, width, pad)]
            ),
            next_R=torch.cat([self.next_R, other.next_R]),
            adapters=self.adapters.merged(other.adapters),
            rope_R=None
            if self.rope_R is None or other.rope_R is None
            else torch.cat([self.rope_R, other.rope_R]),
        )


def pad_left(t_R_L: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """`t_R_L` with `value` before its first column up to `width` columns."""
    missing = width - t_R_L.shape[1]
    if missing == 0:
        return t_R_L
    return F.pad(t_R_L, (missing, 0), value=value)
