"""dpo: direct preference optimisation on chosen/rejected replies, the loss computed client-side.

Each pair is one prompt with a chosen and a rejected reply (treadle/recipes/dpo_data.py: bare
short answers are chosen over sentences, preambles and the wrong person's fact). The reference
policy is the base model: its reply logprobs come from `compute_logprobs` on a sampler of the base
model, which equals the fresh LoRA session (its B is zero), so a run and its resumed half share
one reference. The loss, -log sigmoid(beta * ((lp_c - ref_c) - (lp_r - ref_r))), runs in
`forward_backward_custom`. Per step it logs the loss, preference accuracy (share of pairs with
margin > 0, beyond float noise) and mean margin on the batch; on held-out pairs it logs the same, the share the
policy itself prefers, and the share of greedy replies that are the bare correct answer.

    python -m treadle.recipes.dpo --embedded            # or --base-url/--api-key, --client tinker
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tinker import types

from treadle.recipes import dpo_data
from treadle.recipes.common import metrics, options
from treadle.recipes.common.batching import batch_at
from treadle.recipes.common.chat import datum, prompt_tokens, reply_tokens
from treadle.recipes.common.connect import current_sampler, ready, service
from treadle.recipes.common.evaluate import greedy_score
from treadle.recipes.common.runs import open_run

# A pair counts as won when its margin exceeds this (nats). Before the first update the policy is
# the reference and every margin is a tie; a training forward pass and the sampler then disagree
# by float noise (~1e-6 nats on SmolLM2), which must not count as half the pairs won.
TIE = 1e-3

LossFn = Callable[[list[types.Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class TokenPair:
    """One pair as tokens: the shared prompt and the two replies (each ending in end of turn)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    def datums(self) -> list[types.Datum]:
        """[chosen, rejected], each weighted 1 on its reply tokens and 0 on the prompt's."""
        return [
            datum(self.prompt, reply, weights=[1.0] * len(reply))
            for reply in (self.chosen, self.rejected)
        ]


def tokenise(tokenizer: Any, pair: dpo_data.Pair) -> TokenPair:
    return TokenPair(
        prompt=prompt_tokens(tokenizer, pair.messages),
        chosen=reply_tokens(tokenizer, pair.chosen),
        rejected=reply_tokens(tokenizer, pair.rejected),
    )


def reference_logprobs(sampler: Any, pairs: Sequence[TokenPair]) -> list[tuple[float, float]]:
    """(chosen, rejected) reply logprob sums under `sampler`, all requests in flight at once."""
    futures = [
        (sampler.compute_logprobs(types.ModelInput.from_ints(p.prompt + reply)), len(reply))
        for p in pairs
        for reply in (p.chosen, p.rejected)
    ]
    sums = [float(sum(f.result()[-n:])) for f, n in futures]
    return list(zip(sums[0::2], sums[1::2], strict=True))


def reply_logprob(d: types.Datum, logprobs_T: torch.Tensor) -> torch.Tensor:
    """The reply's logprob: per-target-token logprobs summed where the datum's weight is 1."""
    weights_T = d.loss_fn_inputs["weights"].to_torch().to(logprobs_T.dtype)
    return (logprobs_T * weights_T).sum()


def dpo_loss(
    chosen_B: torch.Tensor,
    rejected_B: torch.Tensor,
    ref_chosen_B: torch.Tensor,
    ref_rejected_B: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean DPO loss over B pairs, and each pair's margin (log-ratio of chosen minus that of
    rejected, in nats; the implicit reward margin is beta times it)."""
    margin_B = (chosen_B - ref_chosen_B) - (rejected_B - ref_rejected_B)
    return -torch.nn.functional.logsigmoid(beta * margin_B).mean(), margin_B


def pair_logprobs(
    data: Sequence[types.Datum], logprobs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reply logprobs of data laid out [chosen 0, rejected 0, chosen 1, ...]: (chosen_B, rejected_B)."""
    if len(data) % 2:
        raise ValueError(f"{len(data)} datums: pairs need an even number, chosen then rejected")
    sums = torch.stack([reply_logprob(d, lp) for d, lp in zip(data, logprobs, strict=True)])
    return sums[0::2], sums[1::2]


def make_loss_fn(reference: Sequence[tuple[float, float]], beta: float) -> LossFn:
    """The loss for forward_backward_custom on pairs' datums, given their reference logprobs."""
    ref_chosen_B = torch.tensor([c for c, _ in reference], dtype=torch.float64)
    ref_rejected_B = torch.tensor([r for _, r in reference], dtype=torch.float64)

    def loss_fn(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        chosen_B, rejected_B = pair_logprobs(data, logprobs)
        loss, margin_B = dpo_loss(
            chosen_B.double(), rejected_B.double(), ref_chosen_B, ref_rejected_B, beta
        )
        return loss, {
            "dpo_loss:mean": float(loss.detach()),
            "accuracy:mean": float((margin_B > TIE).double().mean()),
            "margin:mean": float(margin_B.detach().mean()),
        }

    return loss_fn


def main(argv: list[str] | None = None) -> int:
    p = options.parser(
        "dpo", __doc__.splitlines()[0], steps=20, learning_rate=5e-4, save_every=10, eval_every=10
    )
    p.add_argument(
        "--beta", type=float, default=0.1,
        help="DPO's beta: the weight of staying near the reference (larger: closer)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=4, help="pairs per step")
    p.add_argument("--train-size", type=int, default=240, help="training pairs")
    p.add_argument("--eval-size", type=int, default=16, help="held-out pairs (and prompts)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy reply length at evaluation")
    args, run = open_run(p, argv)
    train = dpo_data.pairs(args.train_size, seed=args.seed)
    held_out = dpo_data.pairs(args.eval_size, seed=10_000 + args.seed)
    with service(args) as svc:
        tc = run.training_client(svc, args)
        tokenizer = tc.get_tokenizer()
        reference_sampler = ready(svc.create_sampling_client(base_model=args.model))
        held_out_tokens = [tokenise(tokenizer, pair) for pair in held_out]
        held_out_reference_B2 = torch.tensor(
            reference_logprobs(reference_sampler, held_out_tokens), dtype=torch.float64
        )
        held_out_datums = [d for pair in held_out_tokens for d in pair.datums()]
        train_reference: dict[int, tuple[float, float]] = {}

        def evaluate(step: int) -> dict[str, Any]:
            out = tc.forward(held_out_datums, "cross_entropy").result()
            chosen_B, rejected_B = pair_logprobs(
                held_out_datums, [o["logprobs"].to_torch() for o in out.loss_fn_outputs]
            )
            _, margin_B = dpo_loss(
                chosen_B.double(), rejected_B.double(),
                held_out_reference_B2[:, 0], held_out_reference_B2[:, 1], args.beta,
            )  # fmt: skip
            answer_rate, replies = greedy_score(
                current_sampler(tc), tokenizer,
                [pair.prompt for pair in held_out_tokens],
                lambda i, text: float(dpo_data.is_correct(text, held_out[i])),
                max_tokens=args.max_tokens,
            )  # fmt: skip
            return log.record(
                step,
                eval_accuracy=float((margin_B > TIE).double().mean()),
                eval_margin=float(margin_B.mean()),
                eval_prefers_chosen=float((chosen_B > rejected_B).double().mean()),
                eval_answer_rate=answer_rate,
                eval_sample=replies[0],
            )

        log = run.metrics_log(args, shown=["loss", "accuracy", "eval_accuracy"])
        if not run.resumed_from:  # a resumed run's file already holds it
            evaluate(0)
        for step in range(run.start_step, args.steps):
            indices = batch_at(range(len(train)), args.batch_size, args.seed, step)
            tokens = {i: tokenise(tokenizer, train[i]) for i in indices}
            missing = [i for i in tokens if i not in train_reference]
            computed = reference_logprobs(reference_sampler, [tokens[i] for i in missing])
            train_reference.update(zip(missing, computed, strict=True))
            batch = [d for i in indices for d in tokens[i].datums()]
            result = train_step(
                tc, batch, make_loss_fn([train_reference[i] for i in indices], args.beta),
                args.learning_rate,
            )  # fmt: skip
            done = step + 1
            log.record(
                done, loss=result["dpo_loss:mean"], accuracy=result["accuracy:mean"],
                margin=result["margin:mean"],
            )  # fmt: skip
            run.step_done(tc, done, args, log, evaluate)
        evaluate(args.steps)
        log.close()
    keys = ("eval_accuracy", "eval_margin", "eval_prefers_chosen", "eval_answer_rate")
    run.finish(
        f"dpo on {args.model}",
        {
            "DPO loss (batch)": ["loss"],
            "preference accuracy": ["accuracy", "eval_accuracy"],
            "margin (nats)": ["margin", "eval_margin"],
            "held-out policy": ["eval_answer_rate", "eval_prefers_chosen"],
        },
        lambda rows: {**{f"{k}_before": metrics.first(rows, k) for k in keys},
                      **{f"{k}_after": metrics.last(rows, k) for k in keys}},
    )  # fmt: skip
    return 0


def train_step(
    tc: Any, batch: list[types.Datum], loss_fn: LossFn, learning_rate: float
) -> dict[str, float]:
    """One forward_backward_custom + optim_step, sent together; the loss function's metrics."""
    fb = tc.forward_backward_custom(batch, loss_fn)
    step = tc.optim_step(types.AdamParams(learning_rate=learning_rate))
    result = {k: float(v) for k, v in fb.result().metrics.items()}
    step.result()
    return result


if __name__ == "__main__":
    sys.exit(main())
