"""The dpo recipe's task: preference pairs for short answers about two people, generated in code.

A prompt gives two people's ages and cities and asks for one of the four facts; the system
message asks for the bare answer ("31", "Kyoto"). The chosen reply is that bare answer. The
rejected one is, in turn, the right answer in a sentence ("Ada is 31 years old."), the other
person's fact in the right format ("45"), or the answer after a preamble ("The answer is: 31.").
The base SmolLM2-135M-Instruct answers in sentences or starts to reason; the pairs prefer the
bare, correct answer, and `is_correct` checks a sampled reply against it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from treadle.recipes.common.chat import Messages

SYSTEM = "Answer with the bare answer only: a number or a city name, never a sentence."
NAMES = ["Ada", "Bram", "Cleo", "Dario", "Elin", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kira", "Lars", "Mina", "Noor", "Otto", "Pia", "Quinn", "Rosa", "Sven", "Tara", "Uma", "Vik", "Wren", "Yara"]  # fmt: skip
CITIES = ["Lisbon", "Tromso", "Kyoto", "Accra", "Valparaiso", "Tallinn", "Hobart", "Quito", "Oslo", "Dakar", "Perth", "Lima", "Hanoi", "Bergen", "Porto", "Cusco"]  # fmt: skip
REJECTED_KINDS = ("sentence", "other_person", "preamble")


@dataclass(frozen=True)
class Pair:
    context: str
    question: str
    chosen: str
    rejected: str
    kind: str  # which of REJECTED_KINDS the rejected reply is

    @property
    def messages(self) -> Messages:
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{self.context} {self.question}"},
        ]


def pairs(n: int, seed: int) -> list[Pair]:
    """`n` pairs; the rejected kinds take turns, so every batch sees a mix of them."""
    rng = random.Random(seed)
    return [_pair(rng, REJECTED_KINDS[i % len(REJECTED_KINDS)]) for i in range(n)]


def _pair(rng: random.Random, kind: str) -> Pair:
    a, b = rng.sample(NAMES, 2)
    city_a, city_b = rng.sample(CITIES, 2)
    age_a, age_b = rng.sample(range(18, 90), 2)
    context = (
        f"{a} is {age_a} years old and lives in {city_a}. "
        f"{b} is {age_b} years old and lives in {city_b}."
    )
    asked, other = (a, b) if rng.random() < 0.5 else (b, a)
    facts = {a: (age_a, city_a), b: (age_b, city_b)}
    if rng.random() < 0.5:
        question, answer = f"How old is {asked}?", str(facts[asked][0])
        sentence, wrong = f"{asked} is {answer} years old.", str(facts[other][0])
    else:
        question, answer = f"Where does {asked} live?", facts[asked][1]
        sentence, wrong = f"{asked} lives in {answer}.", facts[other][1]
    rejected = {
        "sentence": sentence,
        "other_person": wrong,
        "preamble": f"The answer is: {answer}.",
    }[kind]
    return Pair(context, question, chosen=answer, rejected=rejected, kind=kind)


def is_correct(reply: str, pair: Pair) -> bool:
    """The reply is the bare answer (surrounding space and one final full stop allowed)."""
    text = reply.strip()
    return text.removesuffix(".").strip() == pair.chosen
