"""SageMaker's GSM8K GRPO training-session example through Treadle's own SDK against the served
platform (`treadle up`, real workers): the example's code as typed for
`sagemaker.train.training_session`, with only its import line changed to `treadle` (the
platform and key come from TREADLE_BASE_URL / TREADLE_API_KEY, as SageMaker's come from the
AWS environment). Its data is generated arithmetic word problems instead of GSM8K, its base
model treadle/tiny-debug; 2 steps of 2 problems, 2 samples each.

Checked: what each call returns, that each save is a version of the group the ARN names, and
that the session resumed from `save_state()` continues it exactly (weights and optimizer: one
more step on each gives the same logprobs, and a weights-only resume does not).
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import httpx
import pytest

from tests.compat.sagemaker_gsm8k import reward, word_problems
from tests.conftest import Platform
from treadle import (  # the one line that differs from SageMaker's example
    AdamParams,
    Datum,
    ModelInput,
    SamplingParams,
    ServiceClient,
    TensorData,
    TensorDtype,
)
from treadle.client.admin import AdminClient
from treadle.client.checkpoints import CheckpointsClient

pytestmark = [pytest.mark.compat, pytest.mark.integration]

BASE_MODEL = "treadle/tiny-debug"
ROLE_ARN = "arn:aws:iam::123456789012:role/SageMakerTrainingSessionsRole"
REGION = "us-west-2"
MODEL_PACKAGE_GROUP_ARN = f"arn:aws:sagemaker:{REGION}:123456789012:model-package-group/gsm8k-grpo"
S3_OUTPUT_PATH = "s3://my-bucket/gsm8k-grpo"
SESSION_NAME = "gsm8k-grpo-demo"
STEPS, PROBLEMS_PER_STEP, K = 2, 2, 2


def build_training_datum(
    prompt_tokens: list[int],
    completion_tokens: list[int],
    completion_logprobs: list[float],
    advantage: float,
) -> Datum:
    tokens = prompt_tokens + completion_tokens
    n = len(prompt_tokens) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData(data=tokens[1:]),
            "weights": TensorData(data=[0.0] * n + [1.0] * len(completion_tokens)),
            "logprobs": TensorData(data=[0.0] * n + list(completion_logprobs)),
            "advantages": TensorData(data=[0.0] * n + [advantage] * len(completion_tokens)),
        },
    )


def one_more_step(training_client: Any, datum: Datum) -> list[float]:
    """A ppo step on `datum`, then its target logprobs (a check of this test's, not the
    example's: a large learning rate, so a different optimizer state shows)."""
    training_client.forward_backward([datum], loss_fn="ppo").result()
    training_client.optim_step(AdamParams(learning_rate=1e-2)).result()
    out = training_client.forward([datum], loss_fn="ppo").result()
    return [float(x) for x in out.loss_fn_outputs[0]["logprobs"].tolist()]


def describe(platform: Platform, key: str, path: str) -> dict[str, Any]:
    response = httpx.get(f"{platform.base_url}{path}", headers={"X-API-Key": key}, timeout=30)
    response.raise_for_status()
    return response.json()  # type: ignore[no-any-return]


def test_the_gsm8k_example_runs_as_typed_on_treadles_sdk(
    platform: Platform, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"sagemaker-sdk-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    monkeypatch.setenv("TREADLE_BASE_URL", platform.base_url)
    monkeypatch.setenv("TREADLE_API_KEY", key)
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path))

    # --- the example, as typed ----------------------------------------------------------------
    svc = ServiceClient(role_arn=ROLE_ARN, region=REGION)
    base_models = svc.list_base_models()
    training_client = svc.create_lora_training_client(
        BASE_MODEL,
        training_session_name=SESSION_NAME,
        rank=32,
        alpha=64,
        model_package_group_arn=MODEL_PACKAGE_GROUP_ARN,
        s3_output_path=S3_OUTPUT_PATH,
    )
    tokenizer = training_client.get_tokenizer()
    sampling_client = training_client.create_sampling_client()
    sampling_params = SamplingParams(max_tokens=512, temperature=0.7, top_p=0.9)
    problems = word_problems(STEPS * PROBLEMS_PER_STEP)
    samples: list[tuple[list[int], Any]] = []
    metrics: list[tuple[dict[str, float], dict[str, float] | None]] = []
    for step in range(STEPS):
        batch = problems[step * PROBLEMS_PER_STEP : (step + 1) * PROBLEMS_PER_STEP]
        prompts = [tokenizer.encode(question) for question, _ in batch]
        futures = [
            sampling_client.sample(
                ModelInput.from_ints(p), num_samples=K, sampling_params=sampling_params
            )
            for p in prompts
        ]
        datums = []
        for (_, answer), prompt, future in zip(batch, prompts, futures, strict=True):
            result = future.result()
            group = [reward(tokenizer.decode(s.tokens), answer) for s in result.sequences]
            mean = sum(group) / len(group)
            for sequence, r in zip(result.sequences, group, strict=True):
                datums.append(
                    build_training_datum(prompt, list(sequence.tokens), sequence.logprobs, r - mean)
                )
                samples.append((prompt, sequence))
        fb = training_client.forward_backward(datums, loss_fn="ppo")
        opt = training_client.optim_step(AdamParams(learning_rate=1e-5))
        metrics.append((fb.result().metrics, opt.result().metrics))
        sampling_client = training_client.save_weights_and_get_sampling_client()
    prompt = samples[-1][0]
    prompt_logprobs = sampling_client.compute_logprobs(ModelInput.from_ints(prompt)).result()
    merged = training_client.save_weights_for_sampler(merge_weights=True).result()
    state = training_client.save_state().result()
    # (this test's check: the uninterrupted session's next step, for the resumed one to match)
    last_prompt, last = samples[-1]
    probe = build_training_datum(last_prompt, list(last.tokens), last.logprobs, 1.0)
    uninterrupted = one_more_step(training_client, probe)
    training_client.stop()
    with svc.create_training_client_from_state_with_optimizer(state.path) as resumed:
        resumed_step = one_more_step(resumed, probe)
        resumed_state = resumed.save_state().result()

    # --- what it did --------------------------------------------------------------------------
    assert BASE_MODEL in base_models
    assert len(samples) == STEPS * PROBLEMS_PER_STEP * K
    for sample_prompt, sequence in samples:
        assert 0 < len(sequence.tokens) <= 512 and len(sequence.logprobs) == len(sequence.tokens)
        assert sequence.stop_reason in ("stop", "length") and sample_prompt
    for fb_metrics, opt_metrics in metrics:
        assert math.isfinite(fb_metrics["loss:sum"])
        assert opt_metrics is not None
        assert opt_metrics["learning_rate:mean"] == pytest.approx(1e-5)
    assert probe.loss_fn_inputs["target_tokens"].dtype == TensorDtype.INT64  # inferred
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    assert all(lp is not None and lp <= 0 for lp in prompt_logprobs[1:])

    session = describe(platform, key, f"/api/v1/treadle/sessions/{training_client.model_id}")
    assert (session["name"], session["lora_config"]["alpha"]) == (SESSION_NAME, 64)
    assert session["status"] == "Stopped"
    run = describe(platform, key, f"/api/v1/training_runs/{training_client.model_id}")
    assert run["model_package_group"] == "gsm8k-grpo"

    # every save is the next version of the group the ARN names, the resumed session's too
    registry = CheckpointsClient(platform.base_url, key)
    versions = [
        (c["tinker_path"], c["version"], c["is_merged"], c["has_optimizer"])
        for c in registry.list(group="gsm8k-grpo")
    ]
    registry.http.close()
    assert versions == [
        (merged.path, 1, True, False),
        (state.path, 2, False, True),
        (resumed_state.path, 3, False, True),
    ]
    assert merged.path.endswith("/sampler_weights/weights-0001")
    assert state.path.endswith("/weights/state-0001")
    assert resumed_state.path != state.path

    # the resumed session continues the saved one exactly; without its optimizer it would not
    assert resumed_step == uninterrupted
    resumed_session = describe(platform, key, f"/api/v1/treadle/sessions/{resumed.model_id}")
    assert resumed_session["status"] == "Stopped"  # the `with` block stopped it
    with svc.create_training_client_from_state(state.path) as weights_only:
        assert one_more_step(weights_only, probe) != uninterrupted
    svc.close()
