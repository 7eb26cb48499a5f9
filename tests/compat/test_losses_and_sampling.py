"""Every loss and sampling option the pinned tinker SDK can send, through the unmodified SDK against
the served platform (`treadle up`, real workers), as a tenant of this module's own: each is
served with the values its definition gives (docs/losses-and-sampling.md), checked against
another request's answer, or refused with a 400 that names it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.conftest import Platform
from treadle.client.admin import AdminClient

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378]
MODEL_INPUT = types.ModelInput.from_ints(PROMPT)
ONE_TOKEN = types.SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def service(platform: Platform) -> Iterator[tinker.ServiceClient]:
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"losses-sampling-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    yield svc
    svc.close("success").result()


@pytest.fixture(scope="module")
def training(service: tinker.ServiceClient) -> tinker.TrainingClient:
    tc = service.create_lora_training_client(BASE_MODEL, rank=4, seed=7).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # not the base model any more
    return tc


@pytest.fixture(scope="module")
def sampler(training: tinker.TrainingClient) -> tinker.SamplingClient:
    return training.save_weights_and_get_sampling_client().result()


@pytest.fixture(scope="module")
def scored(sampler: tinker.SamplingClient) -> list[float | None]:
    return sampler.compute_logprobs(MODEL_INPUT).result()


# -- sampling options ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["dense", "sparse"])
def test_target_prompt_logprobs_equal_compute_logprobs(
    sampler: tinker.SamplingClient, scored: list[float | None], layout: str
) -> None:
    rows = len(PROMPT) - 1
    ids_R_K = torch.full((rows, 8), -1, dtype=torch.int64)  # mostly -1: CSR pays off
    ids_R_K[:, 0] = torch.tensor(PROMPT[1:])  # each position's own next token
    ids_R_K[2, 5] = 17
    target = (
        types.TensorData.from_torch(ids_R_K)
        if layout == "dense"
        else types.TensorData.from_torch_sparse(ids_R_K, pad_value=-1)
    )
    assert (target.sparse_crow_indices is not None) == (layout == "sparse")

    result = sampler.sample(MODEL_INPUT, 1, ONE_TOKEN, target_prompt_logprobs=target).result()

    got = result.target_prompt_logprobs
    assert got is not None and got.shape == [rows, 8]
    assert (got.sparse_crow_indices is not None) == (layout == "sparse")  # the request's layout
    got_R_K = got.to_numpy()
    np.testing.assert_allclose(got_R_K[:, 0], np.asarray(scored[1:], np.float32), atol=1e-5)
    assert got_R_K[2, 5] < 0 and got_R_K[2, 5] != got_R_K[2, 0]
    assert (got_R_K[:, 1] == 0.0).all()  # -1: no logprob, 0.0 in its place


@pytest.mark.parametrize("last_n", [1, 4])
def test_prompt_logprobs_last_n_is_the_tail_of_compute_logprobs(
    sampler: tinker.SamplingClient, scored: list[float | None], last_n: int
) -> None:
    tail = sampler.compute_logprobs(MODEL_INPUT, prompt_logprobs_last_n=last_n).result()
    assert tail[:-last_n] == [None] * (len(PROMPT) - last_n)
    np.testing.assert_allclose(tail[-last_n:], scored[-last_n:], atol=1e-6)  # type: ignore[arg-type]

    result = sampler.sample(
        MODEL_INPUT,
        1,
        ONE_TOKEN,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
        prompt_logprobs_last_n=last_n,
    ).result()
    assert result.topk_prompt_logprobs is not None
    assert result.topk_prompt_logprobs[:-last_n] == [None] * (len(PROMPT) - last_n)
    assert all(len(row or []) == 2 for row in result.topk_prompt_logprobs[-last_n:])


def test_topk_sample_logprobs_are_the_top_of_the_same_position_scored_again(
    sampler: tinker.SamplingClient,
) -> None:
    k = 3
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=21)
    sequence = sampler.sample(MODEL_INPUT, 1, params, topk_sample_logprobs=k).result().sequences[0]
    assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == 4

    # the same positions as prompt positions of a longer prompt: its top-k prompt logprobs
    again = sampler.sample(
        types.ModelInput.from_ints(PROMPT + sequence.tokens),
        1,
        ONE_TOKEN,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=k,
    ).result()
    assert again.topk_prompt_logprobs is not None
    expected = again.topk_prompt_logprobs[len(PROMPT) :]
    for j, (token, logprob, top) in enumerate(
        zip(sequence.tokens, sequence.logprobs or [], sequence.topk_logprobs, strict=True)
    ):
        assert top is not None and expected[j] is not None
        assert [t for t, _ in top] == [t for t, _ in expected[j]]
        np.testing.assert_allclose([v for _, v in top], [v for _, v in expected[j]], atol=1e-5)
        if token in dict(top):
            assert dict(top)[token] == pytest.approx(logprob, abs=1e-5)


def test_prompt_alt_tokens_logprobs_equal_their_target_logprobs(
    sampler: tinker.SamplingClient,
) -> None:
    k = 5
    params = types.SamplingParams(max_tokens=1, temperature=1.0, seed=4)
    result = sampler.sample(MODEL_INPUT, 1, params, prompt_alt_tokens_k=k).result()
    alt = result.prompt_alt_tokens
    assert alt is not None and alt.tokens.shape == [len(PROMPT) - 1, k]
    tokens_R_K = alt.tokens.to_numpy()
    assert len(np.unique(tokens_R_K)) > len(PROMPT) - 1  # draws, not one token per position

    # the drawn ids, scored by another request: the same logprobs
    target = types.TensorData.from_numpy(tokens_R_K.astype(np.int64))
    scored = sampler.sample(MODEL_INPUT, 1, ONE_TOKEN, target_prompt_logprobs=target).result()
    assert scored.target_prompt_logprobs is not None
    np.testing.assert_allclose(
        alt.logprobs.to_numpy(), scored.target_prompt_logprobs.to_numpy(), atol=1e-5
    )


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": len(PROMPT)}, "last_n"),
        (
            {"target_prompt_logprobs": types.TensorData.from_numpy(np.full((3, 2), 5, np.int64))},
            "target_prompt_logprobs",
        ),
        (
            {"target_prompt_logprobs": types.TensorData.from_numpy(np.full((7, 2), -1, np.int64))},
            "target_prompt_logprobs",
        ),
        ({"topk_sample_logprobs": 21}, "topk_sample_logprobs"),
        ({"prompt_alt_tokens_k": 65}, "prompt_alt_tokens_k"),
    ],
    ids=["last-n-too-long", "target-rows", "target-empty", "topk-sample-bound", "alt-bound"],
)
def test_sampling_options_out_of_bounds_are_refused_by_name(
    sampler: tinker.SamplingClient, kwargs: dict[str, object], named: str
) -> None:
    with pytest.raises(tinker.BadRequestError, match=named):
        sampler.sample(MODEL_INPUT, 1, ONE_TOKEN, **kwargs).result()  # type: ignore[arg-type]


def test_a_recording_sampler_samples_as_any_other(training: tinker.TrainingClient) -> None:
    """record_stability_info records the sequences (tests/compat/test_stability_info.py) and
    changes nothing of what is sampled."""
    recording = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=4, seed=11, temperature=1.0)
    plain = training.save_weights_and_get_sampling_client().result()
    recorded = recording.sample(MODEL_INPUT, 2, params).result().sequences
    expected = plain.sample(MODEL_INPUT, 2, params).result().sequences
    assert [s.tokens for s in recorded] == [s.tokens for s in expected]
    assert all(s.sequence_id for s in recorded)


# -- losses -------------------------------------------------------------------------------------


def _rl_datum(q: list[float], advantages: list[float], **extra: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={
            "target_tokens": PROMPT[1:],
            "logprobs": q,
            "advantages": advantages,
            **extra,  # type: ignore[dict-item]
        },
    )


def test_gspo_loss_is_the_clipped_sequence_ratio_objective(
    training: tinker.TrainingClient,
) -> None:
    n = len(PROMPT) - 1
    lp = np.asarray(
        training.forward([_rl_datum([0.0] * n, [0.0] * n)], "importance_sampling")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .tolist()
    )
    mask = np.asarray([0.0, 0.0] + [1.0] * (n - 2))
    q = lp - np.log(np.linspace(1.1, 1.6, n))  # token ratios 1.1 .. 1.6
    advantages = np.asarray([0.0, 0.0, 1.0, -1.0, 0.5, 1.0, -0.5])
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.25}
    datum = _rl_datum(
        q.astype(np.float32).tolist(),
        advantages.tolist(),
        sequence_ratio_mask=mask.tolist(),
    )

    out = training.forward([datum], "gspo", config).result()

    s = np.exp(np.mean((lp - q)[mask != 0]))  # the geometric mean of the marked token ratios
    assert s > 1.25  # above the clip range: positive advantages clip, negative ones do not
    expected = -np.minimum(s * advantages, np.clip(s, 0.9, 1.25) * advantages)
    assert out.metrics["loss:sum"] == pytest.approx(float(expected.sum()), abs=1e-4)


def test_per_token_clip_thresholds_are_served(training: tinker.TrainingClient) -> None:
    n = len(PROMPT) - 1
    lp = np.asarray(
        training.forward([_rl_datum([0.0] * n, [0.0] * n)], "importance_sampling")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .tolist()
    )
    ratios, advantages = np.full(n, 1.5), np.ones(n)
    high = np.asarray([1.2, 1.2, 2.0, 2.0, 1.2, 1.2, 1.6])
    datum = _rl_datum(
        (lp - np.log(ratios)).astype(np.float32).tolist(),
        advantages.tolist(),
        clip_high_threshold=high.tolist(),
    )
    out = training.forward([datum], "ppo").result()
    expected = -np.minimum(ratios, np.clip(ratios, 0.8, high))  # A = 1
    assert out.metrics["loss:sum"] == pytest.approx(float(expected.sum()), abs=1e-4)


@pytest.mark.parametrize(
    ("loss_fn", "extra", "named"),
    [
        ("stable_reinforce", {}, "datum 0 has no provenance"),
        ("gspo", {}, "sequence_ratio_mask"),
        ("ppo", {"sequence_ratio_mask": [1.0] * 7}, "sequence_ratio_mask"),
        ("gspo", {"sequence_ratio_mask": [0.0] * 7}, "sequence_ratio_mask marks no token"),
        ("cispo", {"clip_low_threshold": [0.8] * 6 + [1.5]}, "clip_low_threshold"),
    ],
    ids=["stable-reinforce", "gspo-no-mask", "unread-input", "empty-mask", "clip-range"],
)
def test_losses_the_server_cannot_serve_as_sent_are_refused_by_name(
    training: tinker.TrainingClient, loss_fn: str, extra: dict[str, list[float]], named: str
) -> None:
    datum = _rl_datum([-1.0] * 7, [1.0] * 7, **extra)
    with pytest.raises(tinker.BadRequestError, match=named):
        training.forward_backward([datum], loss_fn).result()  # type: ignore[arg-type]


def test_provenance_is_ignored_by_a_loss_that_does_not_read_it(
    training: tinker.TrainingClient,
) -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * 7},
    )
    spanned = datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="seq-0", length=7)],
        loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="seq-0", length=7)],
    )
    with_spans = training.forward([spanned], "cross_entropy").result()
    without = training.forward([datum], "cross_entropy").result()
    assert with_spans.metrics["loss:sum"] == pytest.approx(without.metrics["loss:sum"])


# -- top-K targets and the sampler-vs-trainer KL ------------------------------------------------

# K = 8, as sdft pads them: each position's next token, a fixed other, then id 0 at weight 0
# (mostly zeros, so the SDK's from_torch_sparse sends CSR)
K = 8
TOPK_TARGETS = torch.zeros(len(PROMPT) - 1, K, dtype=torch.int64)
TOPK_TARGETS[:-1, 0], TOPK_TARGETS[:-1, 1] = torch.tensor(PROMPT[1:-1]), 17
TOPK_WEIGHTS = torch.zeros(len(PROMPT) - 1, K)
TOPK_WEIGHTS[:-1, 0], TOPK_WEIGHTS[:-1, 1] = 0.6, 0.4


@pytest.mark.parametrize("layout", ["dense", "sparse"])
def test_topk_cross_entropy_is_the_sum_over_its_columns(
    training: tinker.TrainingClient, layout: str
) -> None:
    """(N, K) target_tokens and weights, as tinker-cookbook's sdft sends them: logprobs (N, K),
    each column the 1-D cross_entropy's logprobs of that column's targets, and loss:sum
    -sum w * lp."""
    encode = (
        types.TensorData.from_torch if layout == "dense" else types.TensorData.from_torch_sparse
    )
    targets, weights = encode(TOPK_TARGETS), encode(TOPK_WEIGHTS)
    assert (targets.sparse_crow_indices is not None) == (layout == "sparse")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )
    columns = [
        training.forward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                    loss_fn_inputs={
                        "target_tokens": TOPK_TARGETS[:, k].tolist(),
                        "weights": [1.0] * 7,
                    },
                )
            ],
            "cross_entropy",
        )
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .to_torch()
        for k in range(3)  # the other columns are column 2's: id 0
    ]
    expected_N_K = torch.stack([columns[min(k, 2)] for k in range(K)], -1)

    out = training.forward_backward([datum], "cross_entropy").result()

    logprobs = out.loss_fn_outputs[0]["logprobs"]
    assert logprobs.shape == [7, K]
    assert logprobs.to_torch().shape == (7, K)
    torch.testing.assert_close(logprobs.to_torch(), expected_N_K, rtol=1e-5, atol=1e-5)
    expected = -(TOPK_WEIGHTS * expected_N_K).sum()
    assert out.metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-5)


def test_topk_targets_of_another_shape_are_refused_by_name(training: tinker.TrainingClient) -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(TOPK_TARGETS),
            "weights": types.TensorData.from_torch(TOPK_WEIGHTS[:, :3].contiguous()),
        },
    )
    with pytest.raises(
        tinker.BadRequestError,
        match=r"target_tokens has shape \[7, 8\] and weights has shape \[7, 3\]",
    ):
        training.forward_backward([datum], "cross_entropy").result()


def test_forward_backward_reports_the_sampler_train_kl_over_sampled_targets(
    training: tinker.TrainingClient,
) -> None:
    """The cookbook's datums carry provenance (a prompt span, then the sampled tokens): the KL
    metrics count the sampled targets only, as the cookbook's mask does."""
    n = len(PROMPT) - 1
    q = np.linspace(-3.0, -0.5, n).astype(np.float32)
    datum = _rl_datum(q.tolist(), [0.0, 0.0] + [1.0] * (n - 2)).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="r:0", length=n)],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="r:0", offset=1, length=2),
            types.SampledProvenanceSpan(sequence_id="r:0", length=n - 2),
        ],
    )
    out = training.forward([datum], "importance_sampling").result()
    lp = np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist())
    d = (q - lp)[2:]
    assert out.metrics["kl_sample_train/tokens:sum"] == n - 2
    assert out.metrics["kl_sample_train_v1:mean"] == pytest.approx(d.mean(), rel=1e-5)
    assert out.metrics["kl_sample_train_v2:mean"] == pytest.approx(0.5 * (d**2).mean(), rel=1e-5)


def test_forward_backward_custom_runs_on_topk_logprobs(training: tinker.TrainingClient) -> None:
    """The SDK's client-side custom loss (as sdft's reverse-KL mode uses it) gets (N, K)
    logprobs and sends (N, K) weights = -dC/dlp back with the same targets: the server's
    surrogate loss:sum is -sum(weights * lp)."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(TOPK_TARGETS),
            "weights": types.TensorData.from_torch(TOPK_WEIGHTS),
        },
    )
    seen: list[torch.Tensor] = []

    def mass(
        _: list[types.Datum], lps: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append(lps[0].detach().clone())
        return (TOPK_WEIGHTS * lps[0].exp()).sum(), {}

    out = training.forward_backward_custom([datum], mass).result()

    (lp,) = seen
    assert lp.shape == (7, K)
    grad = TOPK_WEIGHTS * lp.exp()  # dC/dlp, which the SDK sends as -weights
    assert out.metrics["loss:sum"] == pytest.approx(float(grad.sum()), rel=1e-5)
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(float((grad * lp).sum()), rel=1e-4)
