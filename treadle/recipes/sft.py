"""sft: supervised fine-tuning on a chat task the model does not know, with its chat template.

The task is generated in code: a sentence about a person goes in, and the reply must be exactly
one JSON object with their name, age and city (`{"name": "Ada Quorn", "age": 31, "city": "Pell"}`).
The base model answers in prose or with other keys; after a few dozen steps it answers in the
format for people it never saw. Held-out accuracy (exact match of the parsed object) is measured
before training, every --eval-every steps, and after.

    python -m treadle.recipes.sft --embedded            # or --base-url/--api-key, --client tinker
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treadle.recipes.common import metrics, options
from treadle.recipes.common.batching import batch_at
from treadle.recipes.common.chat import Messages, prompt_tokens, supervised_datum
from treadle.recipes.common.connect import current_sampler, service
from treadle.recipes.common.evaluate import greedy_score
from treadle.recipes.common.runs import open_run

SYSTEM = "Extract the person's name, age and city from the sentence. Reply with JSON only."
FIRST = ["Ada", "Bram", "Cleo", "Dario", "Elin", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kira", "Lars", "Mina", "Noor", "Otto", "Pia", "Quinn", "Rosa", "Sven", "Tara", "Uma", "Vik", "Wren", "Yara", "Zane"]  # fmt: skip
LAST = ["Quorn", "Finch", "Marsh", "Okafor", "Lind", "Varga", "Sato", "Brandt", "Ruiz", "Novak", "Haas", "Moreau", "Kaur", "Berg", "Silva", "Chen", "Duarte", "Holm"]  # fmt: skip
CITIES = ["Pell Harbour", "Vessa", "Ostrava Vale", "Marrowdell", "Quintaro", "Lisbon", "Tromso", "Kyoto", "Accra", "Valparaiso", "Tallinn", "Hobart"]  # fmt: skip
TEMPLATES = [
    "{name} is {age} years old and lives in {city}.",
    "Living in {city}, {name} turned {age} this year.",
    "{name}, aged {age}, moved to {city} last spring.",
    "At {age}, {name} still calls {city} home.",
]  # fmt: skip


@dataclass(frozen=True)
class Example:
    sentence: str
    answer: dict[str, Any]

    @property
    def messages(self) -> Messages:
        return self.chat(SYSTEM)

    def chat(self, system: str) -> Messages:
        """The sentence as the user's turn under the system prompt `system`."""
        return [{"role": "system", "content": system}, {"role": "user", "content": self.sentence}]

    @property
    def reply(self) -> str:
        return json.dumps(self.answer)


def examples(n: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        age, city = rng.randint(18, 90), rng.choice(CITIES)
        sentence = rng.choice(TEMPLATES).format(name=name, age=age, city=city)
        out.append(Example(sentence, {"name": name, "age": age, "city": city}))
    return out


def is_correct(reply: str, answer: dict[str, Any]) -> bool:
    """Exact match: the reply, stripped, parses as JSON and equals the expected object."""
    try:
        return bool(json.loads(reply.strip()) == answer)
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = options.parser("sft", __doc__.splitlines()[0], steps=40, learning_rate=5e-4)
    p.add_argument("--batch-size", type=int, default=8, help="examples per step")
    p.add_argument("--train-size", type=int, default=400)
    p.add_argument("--eval-size", type=int, default=64, help="held-out examples")
    p.add_argument("--max-tokens", type=int, default=40, help="reply length at evaluation")
    args, run = open_run(p, argv)
    train = examples(args.train_size, seed=args.seed)
    held_out = examples(args.eval_size, seed=10_000 + args.seed)
    with service(args) as svc:
        tc = run.training_client(svc, args)
        tokenizer = tc.get_tokenizer()
        prompts = [prompt_tokens(tokenizer, ex.messages) for ex in held_out]

        def evaluate(step: int) -> float:
            """Greedy replies to the held-out sentences; the share that are exactly right."""
            accuracy, replies = greedy_score(
                current_sampler(tc), tokenizer, prompts,
                lambda i, text: float(is_correct(text, held_out[i].answer)),
                max_tokens=args.max_tokens,
            )  # fmt: skip
            log.record(step, eval_accuracy=accuracy, eval_sample=replies[0])
            return accuracy

        log = run.metrics_log(args, shown=["loss", "eval_accuracy"])
        if not run.resumed_from:  # a resumed run's file already holds it
            evaluate(0)
        for step in range(run.start_step, args.steps):
            batch = [supervised_datum(tokenizer, ex.messages, ex.reply) for ex in
                     batch_at(train, args.batch_size, args.seed, step)]  # fmt: skip
            loss = train_step(tc, batch, args.learning_rate)
            done = step + 1
            log.record(done, loss=loss)
            run.step_done(tc, done, args, log, evaluate)
        evaluate(args.steps)
        log.close()
    run.finish(
        f"sft on {args.model}",
        {"train loss / token": ["loss"], "held-out accuracy": ["eval_accuracy"]},
        lambda rows: {"held_out_accuracy_before": metrics.first(rows, "eval_accuracy"),
                      "held_out_accuracy_after": metrics.last(rows, "eval_accuracy")},
    )  # fmt: skip
    return 0


def train_step(tc: Any, batch: Sequence[Any], learning_rate: float) -> float:
    """One forward_backward + optim_step, sent together; the loss per reply token."""
    from tinker import types

    tokens = sum(sum(d.loss_fn_inputs["weights"].data) for d in batch)
    fb = tc.forward_backward(list(batch), loss_fn="cross_entropy")
    step = tc.optim_step(types.AdamParams(learning_rate=learning_rate))
    loss = float(fb.result().metrics["loss:sum"]) / tokens
    step.result()
    return loss


if __name__ == "__main__":
    sys.exit(main())
