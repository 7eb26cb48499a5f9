"""A vision-language base model end to end through the plain tinker SDK: a tiny random Qwen3-VL
(tests/vision_models.py) registered with `treadle models add`, trained on datums whose model
input holds an `ImageChunk` (the image reaches the loss: another image gives other logprobs), an
optimizer step, and a sampler from the trained weights prompted with an image, whose samples'
logprobs equal a forward over the same image and tokens; the image's tokens are metered as
prefill, and a replay of the session from its log (images included) verifies every step. A text-only model given an image, an `expected_tokens` other than the image's, bytes
that are not an image and text holding the image token are clear 400s."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

import treadle
from tests import vision_models
from tests.compat.test_registered_models import cli
from tests.conftest import Platform, new_tenant_key
from treadle.platform.models.vision import VisionSpec, image_tokens

pytestmark = pytest.mark.integration

TOL = 1e-4  # float32 end to end, through different kernels (oneDNN-packed sampling)
TEXT = [5, 17, 42, 99, 7, 123, 64, 11]


@pytest.fixture(scope="module")
def registered(
    platform: Platform, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, VisionSpec]:
    folder = vision_models.vl_folder(tmp_path_factory.mktemp("qwen3-vl"))
    name = f"tiny-{secrets.token_hex(3)}/qwen3-vl"
    done = cli(platform, "models", "add", name, "--path", str(folder), "--max-lora-rank", "16")
    assert done.returncode == 0, done.stderr
    entry = json.loads(done.stdout)
    assert entry["architecture"] == "Qwen3VLForConditionalGeneration"
    assert entry["vision"] is not None
    return name, VisionSpec.from_json(entry["vision"])


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    return new_tenant_key(platform, "vision")


@pytest.fixture(scope="module")
def service(platform: Platform, key: str) -> Iterator[tinker.ServiceClient]:
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    yield svc
    svc.close("success").result()


def image_input(
    spec: VisionSpec, data: bytes, tokens: int | None, text: list[int]
) -> types.ModelInput:
    """`text[:2] <vision_start> image <vision_end> text[2:]`, as the cookbook's Qwen3-VL
    renderer lays an image out."""
    return types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[*text[:2], spec.vision_start_token_id]),
            types.ImageChunk(data=data, format="jpeg", expected_tokens=tokens),
            types.EncodedTextChunk(tokens=[spec.vision_end_token_id, *text[2:]]),
        ]
    )


def image_datum(spec: VisionSpec, data: bytes, tokens: int) -> types.Datum:
    model_input = image_input(spec, data, tokens, TEXT)
    n = model_input.length
    targets = [(3 * i + 1) % 390 for i in range(n)]
    return types.Datum(
        model_input=model_input,
        loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * n},
    )


def test_an_image_datum_trains_and_an_image_prompt_samples(
    platform: Platform, key: str, service: tinker.ServiceClient,
    registered: tuple[str, VisionSpec],
) -> None:  # fmt: skip
    name, spec = registered
    since = datetime.now(UTC) - timedelta(hours=1)
    data, other = (
        vision_models.image_bytes(60, 80, seed=0),
        vision_models.image_bytes(60, 80, seed=1),
    )
    n = image_tokens(spec, 60, 80)
    tc = service.create_lora_training_client(name, rank=4, seed=3).result()
    out = tc.forward_backward([image_datum(spec, data, n)], "cross_entropy").result()
    first = np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist())
    assert first.shape == (len(TEXT) + 2 + n,) and np.isfinite(first).all()
    again = tc.forward([image_datum(spec, other, n)], "cross_entropy").result()
    assert not np.allclose(np.asarray(again.loss_fn_outputs[0]["logprobs"].tolist()), first)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = tc.forward([image_datum(spec, data, n)], "cross_entropy").result()
    assert np.abs(np.asarray(after.loss_fn_outputs[0]["logprobs"].tolist()) - first).max() > 1e-4

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = image_input(spec, data, None, TEXT)  # expected_tokens left to the server
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    before = _usage(platform, key, since)
    sampled = sampler.sample(prompt, 2, params).result()
    after_sample = _usage(platform, key, since)
    metered = {
        k: int(after_sample[k]) - int(before[k]) for k in ("prefill_tokens", "sample_tokens")
    }
    # the prompt's tokens, the image's n among them, metered once as prefill
    assert metered["prefill_tokens"] == len(TEXT) + 2 + n
    assert metered["sample_tokens"] == sum(len(s.tokens) for s in sampled.sequences)
    prompt_tokens = len(TEXT) + 2 + n
    for seq in sampled.sequences:
        tokens = list(seq.tokens)
        full = [*TEXT[:2], spec.vision_start_token_id, *[spec.image_token_id] * n,
                spec.vision_end_token_id, *TEXT[2:], *tokens]  # fmt: skip
        datum = types.Datum(
            model_input=image_input(spec, data, n, TEXT + tokens[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
        )
        scored = tc.forward([datum], "cross_entropy").result()
        lp = np.asarray(scored.loss_fn_outputs[0]["logprobs"].tolist())
        np.testing.assert_allclose(np.asarray(seq.logprobs), lp[prompt_tokens - 1 :], atol=TOL)
    scores = sampler.compute_logprobs(image_input(spec, data, n, TEXT)).result()
    assert len(scores) == len(TEXT) + 2 + n and scores[0] is None

    # the images are in the log: a replay recomputes the same gradients and weights
    treadle_svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
    try:
        report = treadle_svc.replay(tc.model_id).report
    finally:
        treadle_svc.close()
    assert report.matched, str(report)
    assert report.verified >= 2  # the forward_backward and the optim_step


def _usage(platform: Platform, key: str, since: datetime) -> dict[str, Any]:
    hour = "%Y-%m-%dT%H:00:00Z"
    window = {
        "since": f"{since:{hour}}",
        "until": f"{datetime.now(UTC) + timedelta(hours=1):{hour}}",
    }
    got = httpx.get(f"{platform.base_url}/api/v1/treadle/usage", params=window,
                    headers={"X-API-Key": key}, timeout=30)  # fmt: skip
    return dict(got.json()["total"])


def test_image_requests_that_cannot_run_are_clear_400s(
    service: tinker.ServiceClient, registered: tuple[str, VisionSpec]
) -> None:
    name, spec = registered
    data = vision_models.image_bytes(60, 80)
    n = image_tokens(spec, 60, 80)
    tc = service.create_lora_training_client(name, rank=4, seed=3).result()
    text_model = service.create_lora_training_client("treadle/tiny-debug", rank=4).result()
    cases: list[tuple[tinker.TrainingClient, types.Datum, str]] = [
        (text_model, image_datum(spec, data, n), "text-only model"),
        (tc, image_datum(spec, data, n + 1), f"expected_tokens is {n + 1}"),
        (tc, image_datum(spec, b"not an image at all", n), "not a jpeg image"),
    ]
    text = [*TEXT, spec.image_token_id]
    cases.append((tc, types.Datum(
        model_input=types.ModelInput.from_ints(text),
        loss_fn_inputs={"target_tokens": text, "weights": [1.0] * len(text)},
    ), "image token"))  # fmt: skip
    for client, datum, message in cases:
        with pytest.raises(tinker.BadRequestError, match=message):
            client.forward_backward([datum], "cross_entropy").result()
    pointer = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=TEXT),
            types.ImageAssetPointerChunk(format="jpeg", location="file:///etc/passwd"),
        ]
    )
    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="image_asset_pointer chunks are not served"):
        sampler.sample(pointer, 1, types.SamplingParams(max_tokens=2)).result()
    base = service.create_sampling_client(base_model="treadle/tiny-debug").result()
    with pytest.raises(tinker.BadRequestError, match="text-only model"):
        prompt = image_input(spec, data, None, TEXT)
        base.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
