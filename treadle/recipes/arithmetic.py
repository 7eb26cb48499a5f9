"""Arithmetic word problems for rl_math: a seeded generator, the prompt, and a strict verifier.

Each problem is one addition or subtraction of small numbers told as a short story, with one
integer answer. The model is asked to end its reply with `#### <answer>`; the verifier reads the
last `####` in the reply and nothing else, so an answer in any other format scores 0.
Pure Python: no client, no model.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from treadle.recipes.common.chat import Messages

SYSTEM = (
    "Solve the math problem. Think briefly, then give the final answer as a number on the last "
    "line, after ####.\nExample: 'Ann has 3 pens and buys 4 more. How many pens does she have?' "
    "-> '3 + 4 = 7\n#### 7'"
)
NAMES = ["Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Gita", "Hugo", "Iris", "Jonas", "Kemi", "Leo", "Maya", "Nils", "Omar", "Priya", "Rafa", "Sara", "Tomas", "Yuki"]  # fmt: skip
THINGS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cookies", "shells", "cards", "stamps", "balloons", "toy cars"]  # fmt: skip
ADD = [
    "{name} has {a} {things}. {name} gets {b} more {things}. How many {things} does {name} have now?",
    "There are {a} {things} in a box. Someone puts in {b} more. How many {things} are in the box?",
    "{name} collected {a} {things} on Monday and {b} {things} on Tuesday. How many {things} did {name} collect in all?",
]  # fmt: skip
SUBTRACT = [
    "{name} has {a} {things} and gives away {b} of them. How many {things} does {name} have left?",
    "There are {a} {things} on a table. {name} takes {b} of them. How many {things} are still on the table?",
    "{name} had {a} {things} and lost {b}. How many {things} does {name} have now?",
]  # fmt: skip
FINAL_ANSWER = re.compile(r"####\s*(-?\d+)")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int

    @property
    def messages(self) -> Messages:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.question}]


def problems(n: int, seed: int, *, max_operand: int = 10) -> list[Problem]:
    """`n` problems from `seed`: a + b or a - b (a >= b, so no negative answers), operands in
    1..max_operand. The same (n, seed, max_operand) always gives the same list."""
    rng = random.Random(f"arithmetic:{seed}")
    out = []
    for _ in range(n):
        name, things = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if rng.random() < 0.5:
            template, answer = rng.choice(ADD), a + b
        else:
            a, b = max(a, b), min(a, b)
            template, answer = rng.choice(SUBTRACT), a - b
        out.append(Problem(template.format(name=name, things=things, a=a, b=b), answer))
    return out


def final_answer(reply: str) -> int | None:
    """The integer after the reply's last `####`, or None when there is no `####` followed by
    an integer."""
    found = FINAL_ANSWER.findall(reply)
    return int(found[-1]) if found else None


def reward(reply: str, answer: int) -> float:
    """1.0 when the reply's final `#### N` is the answer, else 0.0."""
    return 1.0 if final_answer(reply) == answer else 0.0
