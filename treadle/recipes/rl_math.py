"""GRPO on arithmetic word problems: sample K replies per question, reward 1 when the reply's final
`#### N` is the answer (a local verifier), push each reply by its reward minus its group's mean.

Each question is a one-turn environment (ArithmeticEnv; common.envs). Every step refreshes the
sampler from the current weights (save_weights_and_get_sampling_client), plays every question's
group at once (the requests are all in flight together, so the worker batches them), and
trains once on the replies with the `importance_sampling` or `ppo` loss. Every request carries a
seed derived from (--seed, step, question), so a run is reproducible, resumes exactly, and gives
the same numbers through Treadle's SDK and the plain tinker SDK. Held-out accuracy (greedy, the
strict verifier) is measured before training, every --eval-every steps, and after.

    python -m treadle.recipes.rl_math --embedded            # or --base-url/--api-key, --client tinker
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tinker import types

from treadle.recipes import arithmetic
from treadle.recipes.common import metrics, options
from treadle.recipes.common.batching import batch_at, step_seed
from treadle.recipes.common.chat import datum, prompt_tokens
from treadle.recipes.common.connect import current_sampler, service
from treadle.recipes.common.envs import Action, Outcome, group_advantages, run_group
from treadle.recipes.common.evaluate import greedy_score
from treadle.recipes.common.runs import open_run


@dataclass(frozen=True)
class StepResult:
    """What one GRPO step saw and did; `loss` is None when every group was uniform (no signal,
    so no training call)."""

    reward: float  # mean reward of all sampled replies (the share that were right)
    answered: float  # share of replies with a `#### N` at all, right or wrong
    reply_tokens: float  # mean sampled tokens per reply
    sampled_logprob: float  # mean logprob of the sampled tokens (the sampler's own)
    groups_with_signal: int  # groups whose replies did not all score the same
    loss: float | None  # the loss per trained token


def main(argv: list[str] | None = None) -> int:
    p = options.parser(
        "rl_math", __doc__.splitlines()[0], steps=20, learning_rate=5e-4, save_every=4, eval_every=4
    )
    p.add_argument("--loss", choices=["importance_sampling", "ppo"], default="importance_sampling")
    p.add_argument("--group-size", type=int, default=8, help="K: sampled replies per question")
    p.add_argument("--questions", type=int, default=4, help="questions per step")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--max-tokens", type=int, default=40, help="reply length (training and eval)")
    p.add_argument("--train-size", type=int, default=1000, help="training problems")
    p.add_argument("--eval-size", type=int, default=100, help="held-out problems")
    p.add_argument("--max-operand", type=int, default=10, help="largest number in a problem")
    args, run = open_run(p, argv)
    train = arithmetic.problems(args.train_size, seed=args.seed, max_operand=args.max_operand)
    held_out = arithmetic.problems(
        args.eval_size, seed=10_000 + args.seed, max_operand=args.max_operand
    )
    with service(args) as svc:
        tc = run.training_client(svc, args)
        tokenizer = tc.get_tokenizer()
        eval_prompts = [prompt_tokens(tokenizer, pr.messages) for pr in held_out]

        def evaluate(step: int) -> float:
            """Greedy replies to the held-out problems; the share the verifier accepts."""
            accuracy, replies = greedy_score(
                current_sampler(tc), tokenizer, eval_prompts,
                lambda i, text: arithmetic.reward(text, held_out[i].answer),
                max_tokens=args.max_tokens,
            )  # fmt: skip
            log.record(step, eval_accuracy=accuracy, eval_sample=replies[0])
            return accuracy

        log = run.metrics_log(args, shown=["reward", "loss", "eval_accuracy"])
        if not run.resumed_from:  # a resumed run's file already holds it
            evaluate(0)
        for step in range(run.start_step, args.steps):
            started = time.monotonic()
            result = grpo_step(tc, tokenizer, batch_at(train, args.questions, args.seed, step),
                               step, args)  # fmt: skip
            done = step + 1
            log.record(
                done, reward=result.reward, answered=result.answered, loss=result.loss,
                reply_tokens=result.reply_tokens, sampled_logprob=result.sampled_logprob,
                groups_with_signal=result.groups_with_signal,
                step_s=round(time.monotonic() - started, 3),
            )  # fmt: skip
            run.step_done(tc, done, args, log, evaluate)
        evaluate(args.steps)
        log.close()
    run.finish(
        f"rl_math ({args.loss}) on {args.model}",
        {"held-out accuracy (greedy)": ["eval_accuracy"], "train reward (sampled)": ["reward"],
         "loss / token": ["loss"]},
        lambda rows: {"held_out_accuracy_before": metrics.first(rows, "eval_accuracy"),
                      "held_out_accuracy_after": metrics.last(rows, "eval_accuracy")},
    )  # fmt: skip
    return 0


class ArithmeticEnv:
    """One question, one turn: the reply's reward is the strict verifier's (1 or 0)."""

    def __init__(self, problem: arithmetic.Problem, prompt: list[int]) -> None:
        self.problem, self.prompt = problem, prompt

    def observation(self) -> list[int]:
        return self.prompt

    def step(self, action: Action) -> Outcome:
        answered = arithmetic.final_answer(action.text) is not None
        reward = arithmetic.reward(action.text, self.problem.answer)
        return Outcome(reward, done=True, info={"answered": answered})


def grpo_step(
    tc: Any,
    tokenizer: Any,
    batch: Sequence[arithmetic.Problem],
    step: int,
    args: Any,
) -> StepResult:
    """Sample K replies per question from the current weights, score them, train once."""
    sampler = current_sampler(tc)
    prompts = [prompt_tokens(tokenizer, pr.messages) for pr in batch]
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:  # every question's request at once
        played = pool.map(
            lambda q: run_group(
                [ArithmeticEnv(batch[q], prompts[q]) for _ in range(args.group_size)],
                sampler, tokenizer, max_tokens=args.max_tokens, temperature=args.temperature,
                seed=step_seed(args.seed, step, q),
            ),
            range(len(batch)),
        )  # fmt: skip
        episodes_Q = list(played)
    groups: list[tuple[list[int], list[Any], list[float]]] = []
    for prompt, episodes in zip(prompts, episodes_Q, strict=True):
        groups.append((prompt, [e.final.action for e in episodes], group_advantages(episodes)))
    turns = [e.final for episodes in episodes_Q for e in episodes]
    datums = rl_datums(groups)
    loss = train_step(tc, datums, args.loss, args.learning_rate) if datums else None
    return StepResult(
        reward=statistics.fmean(t.reward for t in turns),
        answered=statistics.fmean(float(t.info["answered"]) for t in turns),
        reply_tokens=statistics.fmean(len(t.action.tokens) for t in turns),
        sampled_logprob=statistics.fmean(lp for t in turns for lp in t.action.logprobs),
        groups_with_signal=sum(any(a != 0 for a in adv) for _, _, adv in groups),
        loss=loss,
    )


def rl_datums(groups: Sequence[tuple[list[int], list[Any], list[float]]]) -> list[types.Datum]:
    """One datum per sampled reply with a nonzero advantage; each token's advantage is its
    reply's divided by the tokens trained on in the batch, so the summed loss is a per-token mean
    and the step size does not grow with the batch or the replies' length."""
    kept = [
        (prompt, seq, adv)
        for prompt, sequences, advantages in groups
        for seq, adv in zip(sequences, advantages, strict=True)
        if adv != 0 and seq.tokens
    ]
    tokens = sum(len(seq.tokens) for _, seq, _ in kept)
    return [
        datum(prompt, seq.tokens, logprobs=seq.logprobs,
              advantages=[adv / tokens] * len(seq.tokens))
        for prompt, seq, adv in kept
    ]  # fmt: skip


def train_step(tc: Any, datums: list[types.Datum], loss_fn: str, learning_rate: float) -> float:
    """One forward_backward + optim_step, sent together; the summed loss (already a per-token
    mean, see rl_datums)."""
    fb = tc.forward_backward(datums, loss_fn=loss_fn)
    step = tc.optim_step(types.AdamParams(learning_rate=learning_rate))
    loss = float(fb.result().metrics["loss:sum"])
    step.result()
    return loss


if __name__ == "__main__":
    sys.exit(main())
