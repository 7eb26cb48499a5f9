"""distill: on-policy distillation; a student learns a task from a teacher's logprobs, no labels.

The task is sft's (`treadle.recipes.sft`): a sentence about a person goes in, one JSON object with
their name, age and city comes out. The teacher is a sampler checkpoint (`--teacher`) or, without
one, a LoRA the recipe first trains on that task with supervised steps. The student, a fresh LoRA
on the same base, samples K replies per prompt; the teacher scores those exact tokens with
`compute_logprobs`; each token's advantage is beta * (teacher lp - student lp), the negative
per-token reverse KL, and the `importance_sampling` loss moves the student toward what the teacher
would say. The student never sees an answer: held-out accuracy (greedy, exact match) rises toward
the teacher's, measured before, every --eval-every steps and after.

    python -m treadle.recipes.distill --embedded        # or --teacher tinker://.../sampler_weights/x
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tinker import types

from treadle.recipes.common import metrics, options
from treadle.recipes.common.advantages import reverse_kl
from treadle.recipes.common.batching import batch_at, step_seed
from treadle.recipes.common.chat import datum, prompt_tokens, supervised_datum
from treadle.recipes.common.connect import current_sampler, ready, service
from treadle.recipes.common.evaluate import greedy_score, sample_all
from treadle.recipes.common.runs import open_run
from treadle.recipes.sft import SYSTEM as SFT_SYSTEM
from treadle.recipes.sft import Example, examples, is_correct, train_step

TEACHER = "teacher.json"
# The prompt the teacher is trained on and the student sees: sft's instruction and the shape of
# the answer. On-policy distillation only reinforces what the student samples: with sft's prompt
# alone SmolLM2 starts a reply with `{"` about 3% of the time (it writes `JSON:` and
# pretty-printed JSON, or prose), and in three runs (12-16 steps) the student never moved toward
# the teacher's format. With the shape shown, about one greedy reply in five already matches, and
# the teacher's logprobs have something to reinforce.
SYSTEM = SFT_SYSTEM + ' Use exactly this form: {"name": "...", "age": ..., "city": "..."}'


@dataclass(frozen=True)
class Teacher:
    """The run's teacher, kept in the run folder so --resume distils from the same one."""

    path: str  # tinker://<model_id>/sampler_weights/<name>
    accuracy: float  # its own held-out accuracy
    trained_steps: int  # supervised steps the recipe trained it for (0: given with --teacher)

    def save(self, folder: Path) -> None:
        (folder / TEACHER).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> Teacher:
        return cls(**json.loads((folder / TEACHER).read_text()))


@dataclass(frozen=True)
class Rollout:
    """One sampled reply: its tokens and both models' logprobs of each of them."""

    prompt: list[int]
    completion: list[int]
    student_logprobs: list[float]
    teacher_logprobs: list[float]


def main(argv: list[str] | None = None) -> int:
    p = options.parser("distill", __doc__.splitlines()[0], steps=20, learning_rate=5e-4)
    p.add_argument(
        "--teacher", help="a sampler checkpoint (tinker://.../sampler_weights/...) of the same "
        "base model; without it the recipe first trains one on the task",
    )  # fmt: skip
    p.add_argument("--teacher-steps", type=int, default=10, help="supervised steps of the teacher")
    p.add_argument("--teacher-learning-rate", type=float, default=5e-4)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per step (and teacher step)")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="K replies per prompt")
    p.add_argument("--beta", type=float, default=1.0, help="advantage = beta * (teacher - student)")
    p.add_argument("--temperature", type=float, default=1.0, help="the student's sampling")
    p.add_argument("--train-size", type=int, default=400, help="prompts (and teacher examples)")
    p.add_argument("--eval-size", type=int, default=64, help="held-out examples")
    p.add_argument("--max-tokens", type=int, default=40, help="reply length")
    args, run = open_run(p, argv)
    if run.resumed_from and args.teacher and args.teacher != Teacher.load(run.path).path:
        p.error(
            f"--resume distils from the run's own teacher ({run.path / TEACHER}); drop --teacher"
        )
    train = examples(args.train_size, seed=args.seed)
    held_out = examples(args.eval_size, seed=10_000 + args.seed)
    with service(args) as svc:
        tc = run.training_client(svc, args)
        tokenizer = tc.get_tokenizer()
        eval_prompts = [prompt_tokens(tokenizer, ex.chat(SYSTEM)) for ex in held_out]

        def score(sampler: Any) -> tuple[float, str]:
            """Held-out accuracy of greedy replies, and the first reply (a sample for the log)."""
            accuracy, replies = greedy_score(
                sampler, tokenizer, eval_prompts,
                lambda i, text: float(is_correct(text, held_out[i].answer)),
                max_tokens=args.max_tokens,
            )  # fmt: skip
            return accuracy, replies[0]

        if run.resumed_from:
            teacher = Teacher.load(run.path)
        else:
            path = args.teacher or train_teacher(svc, args, tokenizer, train)
            trained = 0 if args.teacher else args.teacher_steps
            teacher = Teacher(path, score(sampler_at(svc, path))[0], trained)
            teacher.save(run.path)
        teacher_sampler = sampler_at(svc, teacher.path)

        def evaluate(step: int) -> float:
            accuracy, sample = score(current_sampler(tc))
            log.record(step, eval_accuracy=accuracy, teacher_accuracy=teacher.accuracy,
                       eval_sample=sample)  # fmt: skip
            return accuracy

        log = run.metrics_log(args, shown=["reverse_kl", "eval_accuracy"])
        if not run.resumed_from:  # a resumed run's file already holds it
            evaluate(0)
        for step in range(run.start_step, args.steps):
            prompts = [prompt_tokens(tokenizer, ex.chat(SYSTEM)) for ex in
                       batch_at(train, args.batch_size, args.seed, step)]  # fmt: skip
            student = current_sampler(tc)
            rollouts = roll_out(student, teacher_sampler, prompts, args, step)
            train_on(tc, rollouts, args.beta, args.learning_rate)
            done = step + 1
            log.record(done, **rollout_metrics(rollouts))
            run.step_done(tc, done, args, log, evaluate)
        evaluate(args.steps)
        log.close()
    run.finish(
        f"distill on {args.model}",
        {"reverse KL / token (student || teacher)": ["reverse_kl"],
         "held-out accuracy": ["eval_accuracy", "teacher_accuracy"]},
        lambda rows: {
            "teacher": teacher.path, "teacher_accuracy": teacher.accuracy,
            "held_out_accuracy_before": metrics.first(rows, "eval_accuracy"),
            "held_out_accuracy_after": metrics.last(rows, "eval_accuracy"),
            "reverse_kl_first": metrics.first(rows, "reverse_kl"),
            "reverse_kl_last": metrics.last(rows, "reverse_kl"),
        },
    )  # fmt: skip
    return 0


def train_teacher(
    svc: Any, args: argparse.Namespace, tokenizer: Any, train: Sequence[Example]
) -> str:
    """A LoRA trained on the task with supervised steps, saved for sampling; returns its path."""
    tc = ready(svc.create_lora_training_client(args.model, rank=args.rank, seed=args.seed + 1))
    print(f"training a teacher: {args.teacher_steps} supervised steps", file=sys.stderr)
    for step in range(args.teacher_steps):
        batch = [supervised_datum(tokenizer, ex.chat(SYSTEM), ex.reply) for ex in
                 batch_at(train, args.batch_size, args.seed, step)]  # fmt: skip
        loss = train_step(tc, batch, args.teacher_learning_rate)
        if not args.no_progress:
            print(f"  teacher step {step + 1}: loss {loss:.4f}", file=sys.stderr)
    return str(tc.save_weights_for_sampler(f"{args.log_dir.name}-teacher").result().path)


def sampler_at(svc: Any, path: str) -> Any:
    return ready(svc.create_sampling_client(model_path=path))


def roll_out(
    student: Any, teacher: Any, prompts: Sequence[list[int]], args: argparse.Namespace, step: int
) -> list[Rollout]:
    """K student replies per prompt, each scored by the teacher; every request in flight at once."""
    responses = sample_all(
        student, prompts, num_samples=args.samples_per_prompt, max_tokens=args.max_tokens,
        temperature=args.temperature,
        seeds=[step_seed(args.seed, step, i) for i in range(len(prompts))],
    )  # fmt: skip
    replies = [(prompt, seq) for prompt, r in zip(prompts, responses, strict=True)
               for seq in r.sequences]  # fmt: skip
    scored = [
        teacher.compute_logprobs(types.ModelInput.from_ints([*prompt, *seq.tokens]))
        for prompt, seq in replies
    ]
    return [
        Rollout(
            prompt, list(seq.tokens), [float(x) for x in seq.logprobs],
            completion_logprobs(future.result(), len(seq.tokens)),
        )
        for (prompt, seq), future in zip(replies, scored, strict=True)
    ]  # fmt: skip


def completion_logprobs(logprobs_T: Sequence[float | None], n: int) -> list[float]:
    """The last `n` of compute_logprobs' answer on prompt + completion: the completion's tokens,
    each given everything before it."""
    tail = list(logprobs_T[len(logprobs_T) - n :])
    if n < 1 or len(tail) != n or any(lp is None for lp in tail):
        raise ValueError(f"no logprob for some of the last {n} of {len(logprobs_T)} tokens")
    return [float(lp) for lp in tail if lp is not None]


def distill_datum(rollout: Rollout, beta: float) -> types.Datum:
    """importance_sampling inputs: the student's sampling logprobs (the ratio's denominator) and
    per-token advantages beta * (teacher lp - student lp)."""
    advantages = [beta * a for a in reverse_kl(rollout.student_logprobs, rollout.teacher_logprobs)]
    return datum(
        rollout.prompt, rollout.completion,
        logprobs=rollout.student_logprobs, advantages=advantages,
    )  # fmt: skip


def train_on(tc: Any, rollouts: Sequence[Rollout], beta: float, learning_rate: float) -> None:
    """One forward_backward (importance_sampling) + optim_step on the step's rollouts."""
    fb = tc.forward_backward([distill_datum(r, beta) for r in rollouts], "importance_sampling")
    step = tc.optim_step(types.AdamParams(learning_rate=learning_rate))
    fb.result()
    step.result()


def rollout_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """reverse_kl: mean over sampled tokens of student lp - teacher lp, an estimate of the
    per-token KL(student || teacher) on the student's own replies; it falls as the student learns."""
    gaps = [
        s - t for r in rollouts
        for s, t in zip(r.student_logprobs, r.teacher_logprobs, strict=True)
    ]  # fmt: skip
    return {
        "reverse_kl": statistics.fmean(gaps),
        "teacher_logprob": statistics.fmean(t for r in rollouts for t in r.teacher_logprobs),
        "reply_tokens": statistics.fmean(len(r.completion) for r in rollouts),
    }


if __name__ == "__main__":
    sys.exit(main())
