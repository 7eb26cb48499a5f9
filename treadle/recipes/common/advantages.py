"""Advantage estimators: what each sampled token is pushed by in the RL losses."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def group_centred(rewards_G: Sequence[float], *, normalise: bool = False) -> list[float]:
    """GRPO: each sample's reward minus its group's mean (the samples of one prompt); with
    `normalise`, divided by the group's standard deviation too. A group whose samples all scored
    the same gets zeros: it says nothing about which answer is better."""
    mean = statistics.fmean(rewards_G)
    centred = [r - mean for r in rewards_G]
    if not normalise:
        return centred
    std = statistics.pstdev(rewards_G)
    return [c / std if std > 0 else 0.0 for c in centred]


def reverse_kl(
    student_logprobs_T: Sequence[float], teacher_logprobs_T: Sequence[float]
) -> list[float]:
    """On-policy distillation: per sampled token, teacher lp - student lp (the negative of the
    per-token reverse KL estimate), so the student is pushed toward tokens the teacher likes more
    than it does."""
    if len(student_logprobs_T) != len(teacher_logprobs_T):
        raise ValueError(
            f"{len(student_logprobs_T)} student logprobs but {len(teacher_logprobs_T)} teacher ones"
        )
    return [t - s for s, t in zip(student_logprobs_T, teacher_logprobs_T, strict=True)]
