"""code_rl: RL on Python problems in two turns, with a `check_solution` tool run in a sandbox.

Each problem is an environment (treadle.recipes.code_env): the model may call `check_solution`,
which runs its candidate against the problem's visible tests in a local sandbox
(treadle.recipes.sandbox) and returns the results; it then gives its final answer, graded on
the hidden tests: 1 if all pass, 0 if not, -0.1 without a code block. Tool calls and results are
rendered in the model's own chat format (treadle.client.tool_calls).

A pool of --num-rollout-workers threads plays groups (--group-size episodes of one problem) on the
newest published weights while the trainer steps; work for step m may start once weights from
step m - --max-steps-off-policy exist, and a group that still arrives staler than that is
requeued or dropped (--stale-policy). Each group's `forward_backward` is sent as soon as the group
reaches the trainer (gradients add up on the platform until the step's `optim_step`), with the
`importance_sampling`, `ppo` or `cispo` loss over the sampler's own logprobs. Advantages are
centred within each group and carried by the model's own tokens only. Held-out pass rate (greedy
episodes of problems never trained on) is measured before training, every --eval-every steps,
and after. --warmup-steps first trains on two-turn demonstrations of the train problems, so that a
small model learns the tool's format before RL.

    python -m treadle.recipes.code_rl --embedded        # or --base-url/--api-key, --client tinker
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tinker import types

from treadle.recipes import code_problems, humaneval
from treadle.recipes.code_env import CodeEnv, demonstration
from treadle.recipes.code_problems import Problem
from treadle.recipes.common import metrics, options
from treadle.recipes.common.batching import batch_at, step_seed
from treadle.recipes.common.connect import current_sampler, service
from treadle.recipes.common.envs import Episode, episode_datums, group_advantages, run_group
from treadle.recipes.common.rollouts import Rollout, RolloutPool, StalePolicy, Work
from treadle.recipes.common.runs import open_run
from treadle.recipes.sandbox import Limits, LocalSandbox

Group = list[Episode]


def problem_sets(name: str) -> tuple[list[Problem], list[Problem]]:
    """(train, held_out) of --problems."""
    if name == "humaneval":
        return humaneval.problems()
    return code_problems.TRAIN, code_problems.HELD_OUT


def problem_at(train: list[Problem], args: Any, index: int) -> Problem:
    """Work item `index`'s problem: the data order is batch_at's, --batch-size a step."""
    return batch_at(train, args.batch_size, args.seed, index // args.batch_size)[
        index % args.batch_size
    ]


def main(argv: list[str] | None = None) -> int:
    p = options.parser(
        "code_rl", __doc__.splitlines()[0], steps=12, learning_rate=5e-4, save_every=4, eval_every=4
    )
    p.add_argument(
        "--problems", choices=["easy", "humaneval"], default="easy",
        help="easy: 40 one-line functions (30 train, 10 held out), the CPU demonstration; "
        "humaneval: the 164 HumanEval problems (131 train, 33 held out)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=4, help="groups (problems) per step")
    p.add_argument("--group-size", type=int, default=4, help="episodes played per problem")
    p.add_argument(
        "--max-turns", type=int, choices=[1, 2], default=2,
        help="2: the model may call check_solution and revise; 1: one reply, no tool",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=96, help="length of each reply")
    p.add_argument("--temperature", type=float, default=1.0, help="of the training samples")
    p.add_argument(
        "--loss", choices=["importance_sampling", "ppo", "cispo"], default="importance_sampling",
        help="all weigh each token by its probability ratio to the sampler's, which corrects "
        "for stale groups; ppo clips that ratio, cispo clips it as a stop-gradient weight",
    )  # fmt: skip
    p.add_argument(
        "--num-rollout-workers", type=int, default=2,
        help="threads playing groups while the trainer steps (each runs its own sandboxes)",
    )  # fmt: skip
    p.add_argument(
        "--max-steps-off-policy", type=options.non_negative, default=1,
        help="train on a group at most N optimizer steps after the weights that played it "
        "(0: every group played on the weights it trains)",
    )  # fmt: skip
    p.add_argument(
        "--stale-policy", choices=[s.value for s in StalePolicy], default="requeue",
        help="a group that arrives staler than --max-steps-off-policy: play it again on the "
        "newest weights (requeue) or discard it for the next problem (drop)",
    )  # fmt: skip
    p.add_argument(
        "--warmup-steps", type=options.non_negative, default=0,
        help="supervised steps on two-turn demonstrations of the train problems (a first reply, "
        "the check_solution call, the tool's answer, the final code) before RL: a model as "
        "small as SmolLM2-135M does not call the tool otherwise (--problems easy only)",
    )  # fmt: skip
    p.add_argument("--cpu-seconds", type=int, default=2, help="sandbox CPU limit per run")
    p.add_argument("--wall-seconds", type=float, default=5.0, help="sandbox wall-clock limit")
    args, run = open_run(p, argv)
    if args.num_rollout_workers < 1:
        p.error(f"--num-rollout-workers must be at least 1, not {args.num_rollout_workers}")
    if args.warmup_steps and (args.problems != "easy" or args.max_turns != 2):
        p.error("--warmup-steps demonstrates the tool on the easy problems' reference solutions: "
                "it needs --problems easy and --max-turns 2")  # fmt: skip
    train, held_out = problem_sets(args.problems)
    sandbox = LocalSandbox(Limits(cpu_seconds=args.cpu_seconds, wall_seconds=args.wall_seconds))
    with service(args) as svc:
        tc = run.training_client(svc, args)
        tokenizer = tc.get_tokenizer()

        def play(work: Work, sampler: Any) -> Group:
            """One group: --group-size episodes of the work's problem."""
            problem = problem_at(train, args, work.index)
            envs = [CodeEnv(problem, tokenizer, sandbox, max_turns=args.max_turns)
                    for _ in range(args.group_size)]  # fmt: skip
            return run_group(envs, sampler, tokenizer, max_tokens=args.max_tokens,
                             temperature=args.temperature,
                             seed=step_seed(args.seed, work.index, work.attempt))  # fmt: skip

        def evaluate(step: int, sampler: Any = None) -> float:
            sampler = sampler or pool.latest()[0]
            with ThreadPoolExecutor(max_workers=4) as threads:
                played = list(threads.map(
                    lambda pr: run_group([CodeEnv(pr, tokenizer, sandbox, max_turns=args.max_turns)],
                                         sampler, tokenizer, max_tokens=args.max_tokens,
                                         temperature=0.0, seed=0)[0],
                    held_out,
                ))  # fmt: skip
            rate = sum(e.final.info.get("outcome") == "passed" for e in played) / len(played)
            called = sum(len(e.turns) > 1 for e in played) / len(played)
            log.record(step, eval_pass_rate=rate, eval_tool_call_rate=called,
                       eval_sample=json.dumps(episode_record(held_out[0], played[0])))  # fmt: skip
            return rate

        log = run.metrics_log(
            args, shown=["reward_mean", "pass_rate", "tool_call_rate", "eval_pass_rate"]
        )
        if not run.resumed_from:  # a resumed run's file already holds it (and its warm-up)
            evaluate(0, current_sampler(tc))
            if args.warmup_steps:  # before any rollout: RL starts from the warmed-up weights
                warm_up(tc, train, tokenizer, sandbox, args, log)
                rate = evaluate(0, current_sampler(tc))
                log.record(0, eval_pass_rate_after_warmup=rate)
        pool: RolloutPool[Group] = RolloutPool(
            play, current_sampler(tc), num_workers=args.num_rollout_workers,
            batch_size=args.batch_size, start_step=run.start_step,
            max_steps_off_policy=args.max_steps_off_policy,
            stale_policy=StalePolicy(args.stale_policy),
        )  # fmt: skip
        try:
            for step in range(run.start_step, args.steps):
                started = time.monotonic()
                rollouts, loss, datums, waited = train_step(tc, pool, step, args)
                pool.publish(current_sampler(tc), step + 1)
                done = step + 1
                write_samples(run.path / "samples", done, train, args, rollouts)
                oldest = min(r.sampler_step for r in rollouts)
                log.record(done, **batch_metrics([e for r in rollouts for e in r.result]),
                           loss=loss, datums=datums, staleness=step - oldest,
                           sampler_step=oldest, requeued=pool.requeued, dropped=pool.dropped,
                           wait_s=round(waited, 3),
                           sample_s=round(max(r.seconds for r in rollouts), 3),
                           step_s=round(time.monotonic() - started, 3))  # fmt: skip
                run.step_done(tc, done, args, log, evaluate)
            evaluate(args.steps)
        finally:
            pool.close()
        log.close()
    run.finish(
        f"code_rl ({args.max_turns} turns, {args.loss}) on {args.model}",
        {"train episodes": ["reward_mean", "pass_rate", "tool_call_rate"],
         "held-out pass rate (greedy)": ["eval_pass_rate"], "staleness (steps)": ["staleness"]},
        lambda rows: {
            "held_out_pass_rate_before": metrics.first(rows, "eval_pass_rate"),
            "held_out_pass_rate_after_warmup": metrics.last(rows, "eval_pass_rate_after_warmup"),
            "held_out_pass_rate_after": metrics.last(rows, "eval_pass_rate"),
            "max_staleness": max((r["staleness"] for r in rows if "staleness" in r), default=0),
            "requeued": metrics.last(rows, "requeued"), "dropped": metrics.last(rows, "dropped"),
        },
    )  # fmt: skip
    return 0


def warm_up(
    tc: Any, train: list[Problem], tokenizer: Any, sandbox: Any, args: Any, log: Any
) -> None:
    """--warmup-steps supervised steps of --batch-size demonstrations (code_env.demonstration:
    every other one's first attempt wrong, then revised), cross-entropy on the model's own turns
    only; each step's loss per trained token is logged as `warmup_loss`."""
    for step in range(args.warmup_steps):
        batch = batch_at(train, args.batch_size, args.seed + 1, step)
        data = []
        for i, problem in enumerate(batch):
            tokens, weights = demonstration(problem, tokenizer, sandbox, first_wrong=i % 2 == 1)
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
            ))  # fmt: skip
        trained = sum(sum(d.loss_fn_inputs["weights"].data) for d in data)
        fb = tc.forward_backward(data, loss_fn="cross_entropy")
        optim = tc.optim_step(types.AdamParams(learning_rate=args.learning_rate))
        loss = float(fb.result().metrics["loss:sum"]) / trained
        optim.result()
        log.record(0, warmup_step=step + 1, warmup_loss=round(loss, 4))


def train_step(
    tc: Any, pool: RolloutPool[Group], step: int, args: Any
) -> tuple[list[Rollout[Group]], float, int, float]:
    """One optimizer step on --batch-size groups, each group's forward_backward sent as soon as
    the pool hands it over (the platform adds the gradients up until optim_step). Groups whose
    episodes all scored alike carry no signal and are not sent; a step with none still takes its
    optimizer step (one datum, zero advantage) so steps, checkpoints and data order stay
    aligned. Returns the groups, the loss per trained token, the datums trained, and the
    seconds spent waiting for groups."""
    rollouts, futures, tokens, count, waited = [], [], 0, 0, 0.0
    for _ in range(args.batch_size):
        before = time.monotonic()
        rollout = pool.take(step)
        waited += time.monotonic() - before
        rollouts.append(rollout)
        data = [d for episode, adv in zip(rollout.result, group_advantages(rollout.result),
                                          strict=True) if adv != 0.0
                for d in episode_datums(episode, adv)]  # fmt: skip
        if data:
            futures.append(tc.forward_backward(data, loss_fn=args.loss))
            tokens += sum(d.model_input.length for d in data)
            count += len(data)
    if not futures:
        data = episode_datums(rollouts[0].result[0], 0.0)[:1]
        futures.append(tc.forward_backward(data, loss_fn=args.loss))
        tokens += sum(d.model_input.length for d in data)
    optim = tc.optim_step(types.AdamParams(learning_rate=args.learning_rate))
    loss = sum(float(f.result().metrics["loss:sum"]) for f in futures) / max(tokens, 1)
    optim.result()
    return rollouts, loss, count, waited


def batch_metrics(episodes: list[Episode]) -> dict[str, float]:
    n = len(episodes)

    def share(test: Any) -> float:
        return round(sum(bool(test(e)) for e in episodes) / n, 4)

    return {
        "reward_mean": round(sum(e.reward for e in episodes) / n, 4),
        "pass_rate": share(lambda e: e.final.info.get("outcome") == "passed"),
        "no_code_rate": share(lambda e: e.final.info.get("outcome") == "no code"),
        "tool_call_rate": share(lambda e: len(e.turns) > 1),
        "unreadable_call_rate": share(
            lambda e: e.final.info.get("outcome") == "unreadable tool call"
        ),
    }


def episode_record(problem: Problem, episode: Episode) -> dict[str, Any]:
    """An episode for the samples file: each turn's reply, tool calls and tool results."""
    return {
        "problem": problem.name,
        "reward": episode.reward,
        "outcome": episode.final.info.get("outcome"),
        "reply": episode.final.action.text,
        "turns": [{"reply": t.action.text, **t.info} for t in episode.turns],
    }


def write_samples(
    folder: Path, step: int, train: list[Problem], args: Any, rollouts: list[Rollout[Group]]
) -> None:
    """samples/step-000001.jsonl: every episode the step trained on, turn by turn."""
    folder.mkdir(exist_ok=True)
    with (folder / f"step-{step:06d}.jsonl").open("w") as f:
        for rollout in rollouts:
            index = rollout.work.index
            problem = batch_at(train, args.batch_size, args.seed, index // args.batch_size)[
                index % args.batch_size
            ]
            for episode in rollout.result:
                record = {
                    **episode_record(problem, episode),
                    "work": index,
                    "attempt": rollout.work.attempt,
                    "sampler_step": rollout.sampler_step,
                }
                f.write(json.dumps(record) + "\n")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
