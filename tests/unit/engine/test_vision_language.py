"""A vision-language model (a tiny random Qwen3-VL) in the engine: a datum's image reaches the
loss and the LoRA grads exactly as transformers + peft compute them from the processor's own
inputs (the model computing its own multimodal positions), LoRA adapts the language model
only, and samples from an image prompt are the tokens transformers' own greedy decoding gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from tests import vision_models
from treadle.engine import Engine, EngineDatum, LoraSpec, SamplingSpec
from treadle.engine.lora.targets import resolve
from treadle.engine.models.loading import load_base_model
from treadle.engine.models.vision import EngineImage
from treadle.engine.sampling.decode import SampleRequest
from treadle.engine.sampling.prompt_scores import PromptScoring
from treadle.platform.errors import ValidationError
from treadle.platform.models import model_files
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.models.vision import image_tokens

SPEC = LoraSpec(rank=4, alpha=8.0, seed=1)


@pytest.fixture(scope="module")
def info(tmp_path_factory: pytest.TempPathFactory) -> BaseModelInfo:
    folder = vision_models.vl_folder(tmp_path_factory.mktemp("qwen3-vl"))
    return model_files.inspect_folder("t/qwen3-vl", folder, model_files.Options())


def engine_for(info: BaseModelInfo, root: Path) -> Engine:
    return Engine(cache_dir=root / "cache", device="cpu", models={info.name: info}.__getitem__)


def image_datum(info: BaseModelInfo, data: bytes, width: int, height: int) -> EngineDatum:
    """`<vision_start> image <vision_end> text`, every next token a target."""
    assert info.vision is not None
    n = image_tokens(info.vision, width, height)
    v = info.vision
    tokens = [5, 9, v.vision_start_token_id, *[v.image_token_id] * n, v.vision_end_token_id]
    tokens += [(7 * i + 3) % 390 for i in range(12)]
    return EngineDatum(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], np.int64),
            "weights": np.ones(len(tokens) - 1, np.float32),
        },
        images=(EngineImage(at=3, tokens=n, format="jpeg", data=data),),
    )


def random_adapter(engine: Engine, info: BaseModelInfo) -> dict[str, np.ndarray]:
    engine.create_adapter("a", info.name, SPEC)
    rng = np.random.default_rng(3)
    weights = {
        k: rng.normal(0, 0.1, v.shape).astype(np.float32)
        for k, v in engine.adapter_weights("a").items()
    }
    engine.set_adapter_weights("a", weights)
    return weights


def test_lora_adapts_the_language_model_and_never_the_vision_tower(
    info: BaseModelInfo, tmp_path: Path
) -> None:
    model, _ = load_base_model(info, tmp_path / "cache", "cpu", torch.float32)
    targets = resolve(model)
    assert targets.attn and targets.mlp
    assert all(".language_model." in n for n in (*targets.attn, *targets.mlp)), targets
    assert not any("visual" in n for n in targets.order)


def test_an_image_datum_trains_as_transformers_and_peft_compute_it(
    info: BaseModelInfo, tmp_path: Path
) -> None:
    data = vision_models.image_bytes(60, 80)
    datum = image_datum(info, data, 60, 80)
    engine = engine_for(info, tmp_path)
    weights = random_adapter(engine, info)
    result = engine.forward_backward("a", [datum], "cross_entropy")
    grads = engine.adapter_grads("a")

    model, _ = load_base_model(info, tmp_path / "cache", "cpu", torch.float32)
    config = LoraConfig(
        r=SPEC.rank,
        lora_alpha=SPEC.alpha,
        target_modules=list(resolve(model).suffixes(SPEC)),
        exclude_modules=r".*visual.*",
        lora_dropout=0.0,
    )
    twin = get_peft_model(model, config)
    theirs = {n.replace(".default.", "."): p for n, p in twin.named_parameters() if ".lora_" in n}
    assert set(theirs) == set(weights)
    with torch.no_grad():
        for name, tensor in theirs.items():
            tensor.copy_(torch.from_numpy(weights[name]))
    import io

    from PIL import Image

    pixels = vision_models.processor()(
        images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt"
    )
    ids = torch.tensor([datum.tokens])
    assert info.vision is not None
    logits = (
        twin(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == info.vision.image_token_id).int(),
        )
        .logits[0]
        .float()
    )
    targets = torch.from_numpy(datum.loss_fn_inputs["target_tokens"])
    logprobs = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    loss = -logprobs.sum()
    loss.backward()

    assert result.metrics["loss:sum"] == pytest.approx(float(loss.detach()), rel=1e-6)
    np.testing.assert_allclose(result.outputs[0]["logprobs"], logprobs.detach().numpy(), atol=1e-5)
    for name, tensor in theirs.items():
        assert tensor.grad is not None
        np.testing.assert_allclose(grads[name], tensor.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_the_image_reaches_the_loss(info: BaseModelInfo, tmp_path: Path) -> None:
    engine = engine_for(info, tmp_path)
    random_adapter(engine, info)
    one = image_datum(info, vision_models.image_bytes(60, 80, seed=0), 60, 80)
    other = image_datum(info, vision_models.image_bytes(60, 80, seed=1), 60, 80)
    first = engine.forward_backward("a", [one], "cross_entropy", forward_only=True)
    again = engine.forward_backward("a", [one], "cross_entropy", forward_only=True)
    second = engine.forward_backward("a", [other], "cross_entropy", forward_only=True)
    assert first.metrics == again.metrics  # deterministic
    assert first.metrics["loss:sum"] != second.metrics["loss:sum"]


def test_an_image_in_a_batch_gives_what_it_gives_alone(info: BaseModelInfo, tmp_path: Path) -> None:
    engine = engine_for(info, tmp_path)
    random_adapter(engine, info)
    image = image_datum(info, vision_models.image_bytes(90, 40, seed=2), 90, 40)
    text = EngineDatum(
        tokens=tuple(range(10, 40)),
        loss_fn_inputs={
            "target_tokens": np.arange(11, 41, dtype=np.int64),
            "weights": np.ones(30, np.float32),
        },
    )
    alone = engine.forward_backward("a", [image], "cross_entropy", forward_only=True)
    batched = engine.forward_backward("a", [text, image], "cross_entropy", forward_only=True)
    np.testing.assert_allclose(
        batched.outputs[1]["logprobs"], alone.outputs[0]["logprobs"], atol=1e-5
    )


def test_an_image_whose_tokens_disagree_with_the_processor_is_refused(
    info: BaseModelInfo, tmp_path: Path
) -> None:
    engine = engine_for(info, tmp_path)
    random_adapter(engine, info)
    datum = image_datum(
        info, vision_models.image_bytes(60, 80), 120, 120
    )  # counted for another size
    with pytest.raises(ValidationError, match="becomes 4 tokens"):
        engine.forward_backward("a", [datum], "cross_entropy")


def image_prompt(
    info: BaseModelInfo, data: bytes, width: int, height: int, *, ends_with_image: bool = False
) -> SampleRequest:
    assert info.vision is not None
    v, n = info.vision, image_tokens(info.vision, width, height)
    prompt = [5, 9, v.vision_start_token_id, *[v.image_token_id] * n]
    if not ends_with_image:
        prompt += [v.vision_end_token_id, 17]
    return SampleRequest(
        info.name,
        None,
        prompt,
        2,
        SamplingSpec(max_tokens=8, temperature=0.0, stop=()),
        PromptScoring(logprobs=True),
        images=(EngineImage(at=3, tokens=n, format="jpeg", data=data),),
    )


@pytest.mark.parametrize("ends_with_image", [False, True])
def test_an_image_prompt_samples_what_transformers_generates_from_it(
    info: BaseModelInfo, tmp_path: Path, ends_with_image: bool
) -> None:
    import io

    from PIL import Image

    data = vision_models.image_bytes(70, 50, seed=4)
    request = image_prompt(info, data, 70, 50, ends_with_image=ends_with_image)
    text = SampleRequest(
        info.name,
        None,
        list(range(20, 31)),
        1,
        SamplingSpec(max_tokens=8, temperature=0.0, stop=()),
    )
    engine = engine_for(info, tmp_path)
    together = engine.sample_batch([text, request])
    alone = engine.sample_batch([request])
    assert not isinstance(together[1], Exception) and not isinstance(alone[0], Exception)

    model, _ = load_base_model(info, tmp_path / "cache", "cpu", torch.float32)
    pixels = vision_models.processor()(
        images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt"
    )
    ids = torch.tensor([list(request.prompt)])
    assert info.vision is not None
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
        "mm_token_type_ids": (ids == info.vision.image_token_id).int(),
    }
    generated = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)
    theirs = generated[0, ids.shape[1] :].tolist()
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    prompt_lp = logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]

    for result in (together[1], alone[0]):
        assert [s.tokens for s in result.sequences] == [theirs, theirs]
        assert result.prompt_logprobs is not None
        np.testing.assert_allclose(result.prompt_logprobs[1:], prompt_lp.numpy(), atol=1e-5)
    assert not isinstance(together[0], Exception)
    assert together[0].sequences[0].tokens == engine.sample_batch([text])[0].sequences[0].tokens  # type: ignore[union-attr]
