"""The sampler-vs-trainer KL of a forward_backward: tinker-cookbook 0.6.1's `kl_sample_train`.

Owns `kl_sample_train`, the metrics a forward_backward returns wherever its data carry the
sampler's logprobs q (the `logprobs` input of importance_sampling, ppo, cispo, dro, gspo; the
recorded ones stable_reinforce reads): over the datums' action tokens, with d = q - lp (lp the
trainer's logprob of the target, this request's `logprobs` output),
    kl_sample_train_v1 = mean(d),  kl_sample_train_v2 = 0.5 * mean(d^2)
as `tinker_cookbook.rl.metrics.compute_kl_sample_train` defines them. The cookbook's action mask
(`mask > 0`) is stripped before the data are sent; here a token counts unless the datum says it is
not an action: a `weights` entry of 0 (the RL losses' per-token mask), or a target its provenance
marks as a prompt token (`EngineDatum.sampled_targets`, or the recorded `sampled_mask`), or
outside gspo's `sequence_ratio_mask`. The means
are exact over one request; the sums (`kl_sample_train/...:sum`) add up across the passes and
requests a forward_backward is split into (v1 = v1_total / tokens over all of them).
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from treadle.engine.losses.functions import EngineDatum

__all__ = ["KL_METRICS", "kl_sample_train"]

KL_METRICS = (
    "kl_sample_train_v1:mean",
    "kl_sample_train_v2:mean",
    "kl_sample_train/v1_total:sum",
    "kl_sample_train/v2_total:sum",
    "kl_sample_train/tokens:sum",
)


def kl_sample_train(
    data: Sequence[EngineDatum],
    arrays: Sequence[Mapping[str, np.ndarray]],
    outputs: Sequence[Mapping[str, np.ndarray]],
) -> dict[str, float]:
    """The KL metrics (KL_METRICS) of validated `arrays` (from `data`) and their `outputs`;
    {} where the loss takes no sampler logprobs. The means only where some token counts."""
    diffs: list[np.ndarray] = []
    for datum, a, out in zip(data, arrays, outputs, strict=True):
        sampler = a.get("sampler_logprobs") if "sampled_mask" in a else a.get("logprobs")
        if sampler is None:
            return {}
        action = np.ones(len(a["tokens"]), bool)
        if "weights" in a:
            action &= a["weights"] > 0
        for mask in ("sampled_mask", "sequence_ratio_mask"):  # recorded; gspo's own
            if mask in a:
                action &= a[mask] > 0
        if datum.sampled_targets is not None:
            action &= np.asarray(datum.sampled_targets, bool)
        trainer = out["logprobs"]
        diffs.append(sampler[action].astype(np.float64) - trainer[action].astype(np.float64))
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    metrics = {
        "kl_sample_train/v1_total:sum": float(d.sum()),
        "kl_sample_train/v2_total:sum": float(0.5 * (d**2).sum()),
        "kl_sample_train/tokens:sum": float(d.size),
    }
    if d.size:
        metrics["kl_sample_train_v1:mean"] = float(d.mean())
        metrics["kl_sample_train_v2:mean"] = float(0.5 * (d**2).mean())
    return metrics
