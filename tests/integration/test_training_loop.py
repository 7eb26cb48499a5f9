"""End to end over real HTTP, a real Celery worker process, PostgreSQL and Redis."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

import treadle

pytestmark = pytest.mark.integration

TEXT_TOKENS = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4258, 314, 5031, 30]


def test_treadle_sdk_loop_lowers_loss_and_samples(platform) -> None:
    with treadle.ServiceClient(base_url=platform.base_url, api_key=platform.admin_key) as svc:
        assert "treadle/tiny-debug" in svc.list_base_models()
        with svc.create_lora_training_client(
            "treadle/tiny-debug", training_session_name="loop", rank=8, alpha=16
        ) as tc:
            ids = tc.get_tokenizer().encode("The capital of France is Paris.")
            assert len(ids) > 3
            datums = [
                treadle.Datum(
                    model_input=treadle.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
                )
            ]
            losses = []
            for _ in range(10):
                fut = tc.forward_backward(datums, loss_fn="cross_entropy")
                tc.optim_step(treadle.AdamParams(learning_rate=5e-3))  # sent before fb finishes
                out = fut.result()
                losses.append(out.metrics["loss:sum"])
                assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(ids) - 1
            assert losses[-1] < losses[0] * 0.9, losses

            sc = tc.save_weights_and_get_sampling_client()
            res = sc.sample(
                [1, 2, 3],
                num_samples=4,
                sampling_params=treadle.SamplingParams(max_tokens=16, temperature=0.7),
            ).result()
            assert len(res.sequences) == 4
            for seq in res.sequences:
                assert 1 <= len(seq.tokens) <= 16
                assert len(seq.logprobs) == len(seq.tokens)
                assert all(lp <= 0 for lp in seq.logprobs)
            model_id = tc.model_id
        info = httpx.get(
            f"{platform.base_url}/api/v1/treadle/sessions/{model_id}",
            headers={"X-API-Key": platform.admin_key},
        ).json()
        assert info["status"] == "Stopped"
        assert info["name"] == "loop"
        assert info["lora_config"]["alpha"] == 16


def test_plain_tinker_sdk_loop_lowers_loss(platform) -> None:
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=platform.admin_key)
    tc = svc.create_lora_training_client("treadle/tiny-debug", rank=8).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TEXT_TOKENS[:-1]),
        loss_fn_inputs={
            "target_tokens": TEXT_TOKENS[1:],
            "weights": [1.0] * (len(TEXT_TOKENS) - 1),
        },
    )
    losses = []
    for _ in range(10):
        fb = tc.forward_backward([datum], "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"])
        assert "learning_rate:mean" in step.result().metrics
    assert losses[-1] < losses[0] * 0.9, losses

    sampler = tc.save_weights_and_get_sampling_client().result()
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(TEXT_TOKENS)).result()
    assert logprobs[0] is None and len(logprobs) == len(TEXT_TOKENS)
    base = svc.create_sampling_client(base_model="treadle/tiny-debug").result()
    res = base.sample(
        types.ModelInput.from_ints([1, 2, 3]),
        2,
        types.SamplingParams(max_tokens=4, temperature=0.0),
    ).result()
    assert res.sequences[0].tokens == res.sequences[1].tokens  # greedy
    svc.close("success").result()
    stopped = httpx.get(
        f"{platform.base_url}/api/v1/treadle/sessions/{tc.model_id}",
        headers={"X-API-Key": platform.admin_key},
    ).json()
    assert stopped["status"] == "Stopped"  # finishing the client session stops its models
