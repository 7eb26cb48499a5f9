"""The kto recipe's task: binary feedback on single replies (unpaired), generated in code.

The prompts are the dpo recipe's (treadle/recipes/dpo_data.py: two people's ages and cities, one
fact asked, the bare answer wanted). Each prompt carries one reply with a thumbs up or down, never
both: a desirable reply is the bare right answer, an undesirable one is one of dpo_data's rejected
forms (the answer in a sentence, the other person's fact, the answer after a preamble). Within a
split the labels alternate, so half of the examples are desirable.

The held-out split is a fixed rule on the prompt: a prompt whose text has a CRC-32 divisible by
HELD_OUT_EVERY is held out. No prompt is in both splits, and neither split changes with the
other's size.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from treadle.recipes import dpo_data
from treadle.recipes.common.chat import Messages

HELD_OUT_EVERY = 8


@dataclass(frozen=True)
class Feedback:
    """One prompt, one reply and its label; `pair` keeps the prompt's right answer for scoring."""

    pair: dpo_data.Pair
    reply: str
    is_desirable: bool

    @property
    def messages(self) -> Messages:
        return self.pair.messages

    @property
    def kind(self) -> str:
        """ "answer" for a desirable reply, else which of dpo_data.REJECTED_KINDS it is."""
        return "answer" if self.is_desirable else self.pair.kind


def is_held_out(pair: dpo_data.Pair) -> bool:
    return zlib.crc32(pair.messages[-1]["content"].encode()) % HELD_OUT_EVERY == 0


def split(train_size: int, held_out_size: int, seed: int) -> tuple[list[Feedback], list[Feedback]]:
    """(training, held-out) feedback from one seeded stream of the dpo task's pairs."""
    size = train_size + held_out_size
    while True:
        # dpo_data.pairs(n, seed) is a prefix of pairs(m, seed) for m > n: a longer stream keeps
        # the pairs already drawn, so each split's first items stay the same.
        stream = dpo_data.pairs(size, seed)
        train = [p for p in stream if not is_held_out(p)]
        held_out = [p for p in stream if is_held_out(p)]
        if len(train) >= train_size and len(held_out) >= held_out_size:
            return _labelled(train[:train_size]), _labelled(held_out[:held_out_size])
        size *= 2


def _labelled(pairs: list[dpo_data.Pair]) -> list[Feedback]:
    """Desirable (the chosen reply) at even positions, undesirable (the rejected one) at odd."""
    return [
        Feedback(p, p.chosen, is_desirable=True) if i % 2 == 0
        else Feedback(p, p.rejected, is_desirable=False)
        for i, p in enumerate(pairs)
    ]  # fmt: skip
