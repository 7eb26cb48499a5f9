"""code_rl: RL on small Python problems, each reply's function run against unit tests in a sandbox.

The model writes a function and a local sandbox (treadle.recipes.sandbox) runs its unit tests.
Sampling and training overlap, with a limit on how stale the sampling weights may be.

Each step takes --batch-size problems (code_problems.TRAIN), samples --group-size replies to each,
and scores every reply in the sandbox: 1 if the tests pass, 0 if not, -0.1 without a code block.
Advantages are centred within each problem's group, and the `importance_sampling` (or `ppo`)
loss, which corrects for the sampler's own logprobs, trains on the replies that differ from their
group. A background thread samples the next batches while the trainer trains: batch n may start
once weights from step n - --max-steps-off-policy exist, and uses the newest there are, so no
batch is ever trained on more than that many steps after its weights (the staleness is logged
per step; 0 means fully on-policy, no overlap). Held-out pass rate (greedy, 10 problems never
trained on) is measured before training, every --eval-every steps, and after.

    python -m treadle.recipes.code_rl --embedded        # or --base-url/--api-key, --client tinker
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker import types

from treadle.recipes.code_problems import HELD_OUT, TRAIN, Problem, reward
from treadle.recipes.common import metrics, options
from treadle.recipes.common.advantages import group_centred
from treadle.recipes.common.batching import batch_at, step_seed
from treadle.recipes.common.chat import completion_text, datum, prompt_tokens
from treadle.recipes.common.connect import current_sampler, service
from treadle.recipes.common.evaluate import greedy_score, sample_all
from treadle.recipes.common.runs import open_run
from treadle.recipes.sandbox import Limits


@dataclass(frozen=True)
class Reply:
    tokens: list[int]
    logprobs: list[float]
    text: str
    reward: float
    outcome: str  # the sandbox's outcome, or "no code"


@dataclass(frozen=True)
class Batch:
    step: int  # the optimizer step it is for: its problems are batch_at(TRAIN, ..., step)
    sampler_step: int  # optimizer steps the weights that sampled it had taken
    groups: list[tuple[Problem, list[int], list[Reply]]]  # problem, prompt tokens, its replies
    seconds: float  # sampling and scoring


class Samplers:
    """The newest sampling client and the step of its weights. The sampling thread waits here
    until weights recent enough for the batch it is about to sample have been published."""

    def __init__(self, client: Any, step: int) -> None:
        self._latest = (client, step)
        self._changed = threading.Condition()
        self.closed = False

    def publish(self, client: Any, step: int) -> None:
        with self._changed:
            self._latest = (client, step)
            self._changed.notify_all()

    def latest(self) -> tuple[Any, int]:
        with self._changed:
            return self._latest

    def at_least(self, step: int) -> tuple[Any, int] | None:
        """The newest client once its step is >= `step`; None once closed."""
        with self._changed:
            self._changed.wait_for(lambda: self.closed or self._latest[1] >= step)
            return None if self.closed else self._latest

    def close(self) -> None:
        with self._changed:
            self.closed = True
            self._changed.notify_all()


class Prefetcher:
    """Samples batches start..end-1 in order on a thread of its own; `get()` hands them over."""

    def __init__(
        self, samplers: Samplers, sample: Callable[[Any, int, int], Batch], start: int,
        end: int, max_steps_off_policy: int,
    ) -> None:  # fmt: skip
        self._batches: queue.Queue[Batch | BaseException] = queue.Queue()
        self._samplers, self._sample = samplers, sample
        self._thread = threading.Thread(
            target=self._run, args=(start, end, max_steps_off_policy), daemon=True
        )
        self._thread.start()

    def _run(self, start: int, end: int, max_off: int) -> None:
        try:
            for step in range(start, end):
                newest = self._samplers.at_least(step - max_off)
                if newest is None:
                    return
                self._batches.put(self._sample(newest[0], newest[1], step))
        except BaseException as e:  # handed to the trainer, which raises it
            self._batches.put(e)

    def get(self) -> Batch:
        batch = self._batches.get()
        if isinstance(batch, BaseException):
            raise batch
        return batch

    def close(self) -> None:
        self._samplers.close()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    p = options.parser(
        "code_rl", __doc__.splitlines()[0], steps=12, learning_rate=5e-4, save_every=4, eval_every=4
    )
    p.add_argument("--batch-size", type=int, default=4, help="problems per step")
    p.add_argument("--group-size", type=int, default=4, help="replies sampled per problem")
    p.add_argument("--max-tokens", type=int, default=64, help="reply length")
    p.add_argument("--temperature", type=float, default=1.0, help="of the training samples")
    p.add_argument(
        "--loss", choices=["importance_sampling", "ppo"], default="importance_sampling",
        help="both weigh each token by its probability ratio to the sampler's, which corrects "
        "for stale batches; ppo also clips that ratio",
    )  # fmt: skip
    p.add_argument(
        "--max-steps-off-policy", type=options.non_negative, default=1,
        help="train on a batch at most N optimizer steps after the weights that sampled it "
        "(0: sample each batch after the previous step, no overlap)",
    )  # fmt: skip
    p.add_argument("--sandbox-workers", type=int, default=2, help="sandboxes run at once")
    p.add_argument("--cpu-seconds", type=int, default=2, help="sandbox CPU limit per reply")
    p.add_argument("--wall-seconds", type=float, default=5.0, help="sandbox wall-clock limit")
    args, run = open_run(p, argv)
    limits = Limits(cpu_seconds=args.cpu_seconds, wall_seconds=args.wall_seconds)
    pool = ThreadPoolExecutor(max_workers=args.sandbox_workers)
    with service(args) as svc:
        tc = run.training_client(svc, args)
        tokenizer = tc.get_tokenizer()
        prompts = {pr.name: prompt_tokens(tokenizer, pr.messages) for pr in TRAIN + HELD_OUT}

        def score(problem: Problem, text: str) -> tuple[float, str]:
            value, result = reward(problem, text, limits)
            return value, (result.outcome if result else "no code")

        def sample(sampler: Any, sampler_step: int, step: int) -> Batch:
            started = time.monotonic()
            problems = batch_at(TRAIN, args.batch_size, args.seed, step)
            responses = sample_all(
                sampler, [prompts[pr.name] for pr in problems], num_samples=args.group_size,
                max_tokens=args.max_tokens, temperature=args.temperature,
                seeds=[step_seed(args.seed, step, i) for i in range(len(problems))],
            )  # fmt: skip
            groups = []
            for problem, response in zip(problems, responses, strict=True):
                texts = [completion_text(tokenizer, s.tokens) for s in response.sequences]
                scores = list(pool.map(lambda t, pr=problem: score(pr, t), texts))
                replies = [Reply(list(s.tokens), list(s.logprobs), t, r, o) for s, t, (r, o)
                           in zip(response.sequences, texts, scores, strict=True)]  # fmt: skip
                groups.append((problem, prompts[problem.name], replies))
            return Batch(step, sampler_step, groups, time.monotonic() - started)

        def evaluate(step: int) -> float:
            sampler, _ = samplers.latest()
            rate, replies = greedy_score(
                sampler, tokenizer, [prompts[pr.name] for pr in HELD_OUT],
                lambda i, text: float(score(HELD_OUT[i], text)[0] == 1.0),
                max_tokens=args.max_tokens,
            )  # fmt: skip
            log.record(step, eval_pass_rate=rate, eval_sample=replies[0])
            return rate

        log = run.metrics_log(
            args, shown=["reward_mean", "pass_rate", "staleness", "eval_pass_rate"]
        )
        samplers = Samplers(current_sampler(tc), run.start_step)
        if not run.resumed_from:  # a resumed run's file already holds it
            evaluate(0)
        prefetch = Prefetcher(samplers, sample, run.start_step, args.steps,
                              args.max_steps_off_policy)  # fmt: skip
        try:
            for step in range(run.start_step, args.steps):
                waited = time.monotonic()
                batch = prefetch.get()
                waited = time.monotonic() - waited
                staleness = step - batch.sampler_step
                assert batch.step == step and 0 <= staleness <= args.max_steps_off_policy
                trained = time.monotonic()
                loss, datums = train_step(tc, batch, args.loss, args.learning_rate)
                samplers.publish(current_sampler(tc), step + 1)
                done = step + 1
                write_samples(run.path / "samples", batch)
                log.record(done, **batch_metrics(batch), loss=loss, datums=datums,
                           staleness=staleness, sampler_step=batch.sampler_step,
                           wait_s=round(waited, 3), sample_s=round(batch.seconds, 3),
                           train_s=round(time.monotonic() - trained, 3))  # fmt: skip
                run.step_done(tc, done, args, log, evaluate)
        finally:
            prefetch.close()
            pool.shutdown()
        evaluate(args.steps)
        log.close()
    run.finish(
        f"code_rl on {args.model}",
        {"train replies": ["reward_mean", "pass_rate"], "held-out pass rate (greedy)":
         ["eval_pass_rate"], "staleness (steps)": ["staleness"]},
        lambda rows: {
            "held_out_pass_rate_before": metrics.first(rows, "eval_pass_rate"),
            "held_out_pass_rate_after": metrics.last(rows, "eval_pass_rate"),
            "max_staleness": max((r["staleness"] for r in rows if "staleness" in r), default=0),
        },
    )  # fmt: skip
    return 0


def train_step(tc: Any, batch: Batch, loss_fn: str, learning_rate: float) -> tuple[float, int]:
    """One forward_backward + optim_step on the replies whose advantage is not zero; the loss
    per trained token, and how many replies were trained on. A batch where every group scored
    alike still takes its optimizer step (on one reply, with zero advantage) so that steps,
    checkpoints and the data order stay aligned."""
    data = []
    for _, prompt, replies in batch.groups:
        for reply, adv in zip(replies, group_centred([r.reward for r in replies]), strict=True):
            if adv != 0.0:
                data.append(rl_datum(prompt, reply, adv))
    trained = len(data)
    if not data:
        _, prompt, replies = batch.groups[0]
        data = [rl_datum(prompt, replies[0], 0.0)]
    tokens = sum(len(d.model_input.to_ints()) for d in data)
    fb = tc.forward_backward(data, loss_fn=loss_fn)
    step = tc.optim_step(types.AdamParams(learning_rate=learning_rate))
    loss = float(fb.result().metrics["loss:sum"]) / max(tokens, 1)
    step.result()
    return loss, trained


def rl_datum(prompt: Sequence[int], reply: Reply, advantage: float) -> types.Datum:
    return datum(prompt, reply.tokens, logprobs=reply.logprobs,
                 advantages=[advantage] * len(reply.tokens))  # fmt: skip


def batch_metrics(batch: Batch) -> dict[str, float]:
    replies = [r for _, _, rs in batch.groups for r in rs]
    return {
        "reward_mean": round(sum(r.reward for r in replies) / len(replies), 4),
        "pass_rate": round(sum(r.outcome == "passed" for r in replies) / len(replies), 4),
        "no_code_rate": round(sum(r.outcome == "no code" for r in replies) / len(replies), 4),
    }


def write_samples(folder: Path, batch: Batch) -> None:
    """samples/step-000001.jsonl: every reply of the batch, its reward and the sandbox's word."""
    folder.mkdir(exist_ok=True)
    with (folder / f"step-{batch.step + 1:06d}.jsonl").open("w") as f:
        for problem, _, replies in batch.groups:
            for r in replies:
                f.write(json.dumps({"problem": problem.name, "reward": r.reward,
                                    "outcome": r.outcome, "reply": r.text}) + "\n")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
