"""kto: Kahneman-Tversky optimisation from binary feedback, the loss computed client-side.

Each example is one prompt and one reply labelled desirable or undesirable, unpaired
(treadle/recipes/kto_data.py). The reference is the base model: reply logprobs from
`compute_logprobs` on a sampler of the base model, as in the dpo recipe. The loss (Ethayarajh et
al. 2024, eq. 7, as TRL's KTOTrainer computes it), with r = lp - ref of an example's reply:
z_ref = max(0, mean of lp - ref over the batch's mismatched pairs, prompt i with reply i-1),
detached; a desirable example costs lambda_D (1 - sigmoid(beta (r - z_ref))), an undesirable one
lambda_U (1 - sigmoid(beta (z_ref - r))); the loss is their mean over the batch. The mismatched
pairs' policy logprobs come from `forward` (no gradient flows through z_ref); the loss runs in
`forward_backward_custom`. Logged per step and on held-out examples: the loss, z_ref, each
label's mean implicit reward (beta r) and the reward margin (desirable minus undesirable).

    python -m treadle.recipes.kto --embedded            # or --base-url/--api-key, --client tinker
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tinker import types

from treadle.recipes import dpo_data, kto_data
from treadle.recipes.common import metrics, options
from treadle.recipes.common.batching import batch_at
from treadle.recipes.common.chat import datum, prompt_tokens, reply_tokens
from treadle.recipes.common.connect import current_sampler, ready, service
from treadle.recipes.common.evaluate import greedy_score
from treadle.recipes.common.runs import open_run
from treadle.recipes.dpo import TIE, LossFn, reply_logprob, train_step


@dataclass(frozen=True)
class KtoConfig:
    beta: float
    desirable_weight: float  # lambda_D
    undesirable_weight: float  # lambda_U


@dataclass(frozen=True)
class PromptReply:
    """A prompt and a reply as tokens (the reply ends in end of turn)."""

    prompt: list[int]
    reply: list[int]

    def datum(self) -> types.Datum:
        """Weighted 1 on the reply's tokens and 0 on the prompt's."""
        return datum(self.prompt, self.reply, weights=[1.0] * len(self.reply))


def tokenise(tokenizer: Any, example: kto_data.Feedback) -> PromptReply:
    return PromptReply(
        prompt_tokens(tokenizer, example.messages), reply_tokens(tokenizer, example.reply)
    )


def mismatched(examples: Sequence[PromptReply]) -> list[PromptReply]:
    """Each prompt with the previous example's reply (the first with the last's), as TRL builds
    the pairs for the KL estimate: a reply the prompt did not ask for."""
    return [PromptReply(e.prompt, examples[i - 1].reply) for i, e in enumerate(examples)]


def reference_logprobs(sampler: Any, examples: Sequence[PromptReply]) -> list[float]:
    """Reply logprob sums under `sampler`, all requests in flight at once."""
    futures = [
        (sampler.compute_logprobs(types.ModelInput.from_ints(e.prompt + e.reply)), len(e.reply))
        for e in examples
    ]
    return [float(sum(f.result()[-n:])) for f, n in futures]


def kl_estimate(policy_B: torch.Tensor, reference_B: torch.Tensor) -> torch.Tensor:
    """z_ref: the mean log-ratio over mismatched pairs, clamped at 0 and detached (a reference
    point that moves with the policy, never a path for the gradient)."""
    return (policy_B - reference_B).mean().clamp(min=0).detach()


def kto_loss(
    policy_B: torch.Tensor,
    reference_B: torch.Tensor,
    is_desirable_B: torch.Tensor,
    z_ref: torch.Tensor,
    config: KtoConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean KTO loss over B examples, and each example's log-ratio r = lp - ref (nats)."""
    logratio_B = policy_B - reference_B
    desirable_B = config.desirable_weight * (1 - torch.sigmoid(config.beta * (logratio_B - z_ref)))
    undesirable_B = config.undesirable_weight * (
        1 - torch.sigmoid(config.beta * (z_ref - logratio_B))
    )
    return torch.where(is_desirable_B, desirable_B, undesirable_B).mean(), logratio_B


def label_metrics(
    logratio_B: torch.Tensor, is_desirable_B: torch.Tensor, beta: float
) -> dict[str, float]:
    """Each label's mean implicit reward (beta r), their difference (the reward margin) when both
    labels are present, and the share of examples on their label's side of zero (beyond TIE)."""
    reward_B = beta * logratio_B.detach().double()
    out = {
        "accuracy": float(
            torch.where(is_desirable_B, logratio_B > TIE, logratio_B < -TIE).double().mean()
        )
    }
    for name, mask_B in (("desirable", is_desirable_B), ("undesirable", ~is_desirable_B)):
        if mask_B.any():
            out[f"{name}_reward"] = float(reward_B[mask_B].mean())
    if "desirable_reward" in out and "undesirable_reward" in out:
        out["reward_margin"] = out["desirable_reward"] - out["undesirable_reward"]
    return out


def make_loss_fn(
    reference: Sequence[float], is_desirable: Sequence[bool], z_ref: float, config: KtoConfig
) -> LossFn:
    """The loss for forward_backward_custom on examples' datums, given their reference logprobs,
    labels and the batch's z_ref (from the mismatched pairs' forward pass)."""
    reference_B = torch.tensor(reference, dtype=torch.float64)
    is_desirable_B = torch.tensor(is_desirable, dtype=torch.bool)
    z = torch.tensor(z_ref, dtype=torch.float64)

    def loss_fn(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        policy_B = torch.stack(
            [reply_logprob(d, lp) for d, lp in zip(data, logprobs, strict=True)]
        ).double()
        loss, logratio_B = kto_loss(policy_B, reference_B, is_desirable_B, z, config)
        found = label_metrics(logratio_B, is_desirable_B, config.beta)
        return loss, {"kto_loss:mean": float(loss.detach())} | {
            f"{k}:mean": v for k, v in found.items()
        }

    return loss_fn


def policy_logprobs(tc: Any, data: list[types.Datum]) -> torch.Tensor:
    """Reply logprobs of `data` under the session's current weights (`forward`, no gradient)."""
    out = tc.forward(data, "cross_entropy").result()
    return torch.stack(
        [
            reply_logprob(d, o["logprobs"].to_torch())
            for d, o in zip(data, out.loss_fn_outputs, strict=True)
        ]
    ).double()


def main(argv: list[str] | None = None) -> int:
    p = options.parser(
        "kto", __doc__.splitlines()[0], steps=20, learning_rate=5e-4, save_every=10, eval_every=10
    )
    p.add_argument(
        "--beta", type=_positive, default=0.1,
        help="KTO's beta: the scale of the log-ratios in the sigmoid (larger: closer to the "
        "reference)",
    )  # fmt: skip
    p.add_argument(
        "--desirable-weight", type=_positive, default=1.0,
        help="lambda_D, the weight of a desirable example's loss (the paper keeps "
        "lambda_D n_D / (lambda_U n_U) between 1 and 4/3)",
    )  # fmt: skip
    p.add_argument(
        "--undesirable-weight", type=_positive, default=1.0,
        help="lambda_U, the weight of an undesirable example's loss",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=_at_least_two, default=8,
        help="examples per step (z_ref pairs each prompt with another example's reply)",
    )  # fmt: skip
    p.add_argument("--train-size", type=_at_least_two, default=240, help="training examples")
    p.add_argument(
        "--eval-size", type=_at_least_two, default=16,
        help="held-out examples (and prompts), half of them desirable",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=16, help="greedy reply length at evaluation")
    args, run = open_run(p, argv)
    config = KtoConfig(args.beta, args.desirable_weight, args.undesirable_weight)
    train, held_out = kto_data.split(args.train_size, args.eval_size, seed=args.seed)
    with service(args) as svc:
        tc = run.training_client(svc, args)
        tokenizer = tc.get_tokenizer()
        reference_sampler = ready(svc.create_sampling_client(base_model=args.model))
        held_out_tokens = [tokenise(tokenizer, e) for e in held_out]
        held_out_all = held_out_tokens + mismatched(held_out_tokens)
        held_out_reference = torch.tensor(
            reference_logprobs(reference_sampler, held_out_all), dtype=torch.float64
        )
        held_out_datums = [e.datum() for e in held_out_all]
        held_out_desirable_B = torch.tensor([e.is_desirable for e in held_out])
        n = len(held_out)
        train_tokens = [tokenise(tokenizer, e) for e in train]
        # (prompt index, reply index) into `train` -> the reply's reference logprob
        train_reference: dict[tuple[int, int], float] = {}

        def evaluate(step: int) -> dict[str, Any]:
            policy = policy_logprobs(tc, held_out_datums)
            z_ref = kl_estimate(policy[n:], held_out_reference[n:])
            loss, logratio_B = kto_loss(
                policy[:n], held_out_reference[:n], held_out_desirable_B, z_ref, config
            )
            answer_rate, replies = greedy_score(
                current_sampler(tc), tokenizer, [e.prompt for e in held_out_tokens],
                lambda i, text: float(dpo_data.is_correct(text, held_out[i].pair)),
                max_tokens=args.max_tokens,
            )  # fmt: skip
            found = label_metrics(logratio_B, held_out_desirable_B, args.beta)
            return log.record(
                step, eval_loss=float(loss),
                eval_kl=float((policy[n:] - held_out_reference[n:]).mean()),
                **{f"eval_{k}": v for k, v in found.items()},
                eval_answer_rate=answer_rate, eval_sample=replies[0],
            )  # fmt: skip

        log = run.metrics_log(args, shown=["loss", "reward_margin", "eval_reward_margin"])
        if not run.resumed_from:  # a resumed run's file already holds it
            evaluate(0)
        for step in range(run.start_step, args.steps):
            indices = batch_at(range(len(train)), args.batch_size, args.seed, step)
            matched = [(i, i) for i in indices]
            crossed = [(i, indices[k - 1]) for k, i in enumerate(indices)]
            missing = [
                key for key in dict.fromkeys(matched + crossed) if key not in train_reference
            ]
            computed = reference_logprobs(
                reference_sampler,
                [PromptReply(train_tokens[i].prompt, train_tokens[j].reply) for i, j in missing],
            )
            train_reference.update(zip(missing, computed, strict=True))
            batch = [train_tokens[i] for i in indices]
            kl_policy = policy_logprobs(tc, [e.datum() for e in mismatched(batch)])
            z_ref = kl_estimate(
                kl_policy, torch.tensor([train_reference[key] for key in crossed]).double()
            )
            loss_fn = make_loss_fn(
                [train_reference[key] for key in matched],
                [train[i].is_desirable for i in indices], float(z_ref), config,
            )  # fmt: skip
            result = train_step(tc, [e.datum() for e in batch], loss_fn, args.learning_rate)
            done = step + 1
            log.record(
                done, loss=result["kto_loss:mean"], kl=float(z_ref),
                **{k.removesuffix(":mean"): result.get(k) for k in _TRAIN_METRICS},
            )  # fmt: skip
            run.step_done(tc, done, args, log, evaluate)
        evaluate(args.steps)
        log.close()
    keys = ("eval_reward_margin", "eval_desirable_reward", "eval_undesirable_reward",
            "eval_accuracy", "eval_answer_rate")  # fmt: skip
    run.finish(
        f"kto on {args.model}",
        {
            "KTO loss": ["loss", "eval_loss"],
            "reward margin (beta nats)": ["reward_margin", "eval_reward_margin"],
            "held-out mean reward (beta nats)": ["eval_desirable_reward", "eval_undesirable_reward"],
            "KL estimate (nats)": ["kl", "eval_kl"],
            "held-out policy": ["eval_accuracy", "eval_answer_rate"],
        },
        lambda rows: {**{f"{k}_before": metrics.first(rows, k) for k in keys},
                      **{f"{k}_after": metrics.last(rows, k) for k in keys}},
    )  # fmt: skip
    return 0


_TRAIN_METRICS = (
    "accuracy:mean", "desirable_reward:mean", "undesirable_reward:mean", "reward_margin:mean",
)  # fmt: skip


def _positive(text: str) -> float:
    """An argparse type: a finite number above 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return value


def _at_least_two(text: str) -> int:
    """An argparse type: an integer 2 or more (a mismatched pair needs two examples)."""
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be 2 or more, not {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
