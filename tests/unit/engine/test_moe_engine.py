"""MoE base models (tiny Qwen3-MoE and gpt-oss, registered from their folders) in the engine
with their experts adapted (`train_mlp=True`, every SDK's default): registration offers `mlp`;
an adapter trained a step, exported with its optimizer and imported as another adapter has the
same weights and Adam state bit for bit and takes the next step identically; a snapshot of it
paged out to disk samples what it sampled before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests import tiny_models
from tests.architectures import MOE
from treadle.engine import AdamSpec, Engine, EngineDatum, LoraSpec, SamplingSpec
from treadle.platform.models import model_files
from treadle.platform.models.catalog import BaseModelInfo

ADAM = AdamSpec(learning_rate=1e-2)
TOKENS = [5, 17, 42, 99, 7, 123, 64, 11, 250, 3, 77, 18, 5, 9]
PARAMS = SamplingSpec(max_tokens=6, temperature=1.0, seed=11, stop=())


def datum(tokens: list[int]) -> EngineDatum:
    return EngineDatum(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "weights": np.ones(len(tokens) - 1, np.float32),
        },
    )


@pytest.fixture(params=sorted(MOE))
def registered(request: pytest.FixtureRequest, tmp_path: Path) -> BaseModelInfo:
    arch = request.param
    folder = tiny_models.model_folder(arch, tmp_path / arch)
    return model_files.inspect_folder(f"t/{arch}", folder, model_files.Options())


def test_registration_offers_mlp_on_a_moe_model(registered: BaseModelInfo) -> None:
    assert registered.moe_experts
    assert registered.lora_targets == ("attn", "mlp", "unembed")
    registered.check_lora(4, train_attn=True, train_mlp=True, train_unembed=True)


def test_a_moe_adapter_trains_exports_imports_and_pages_its_experts(
    registered: BaseModelInfo, tmp_path: Path
) -> None:
    name = registered.name
    engine = Engine(
        cache_dir=tmp_path / "cache",
        device="cpu",
        models={name: registered}.__getitem__,
        max_loaded_snapshots=1,
        spill_dir=tmp_path / "spill",
    )
    engine.create_adapter("a", name, LoraSpec(rank=4, alpha=8.0, seed=2))
    fresh = engine.adapter_weights("a")
    experts = sorted(n for n in fresh if ".mlp.experts." in n and ".lora_B." in n)
    assert len(experts) == 4  # gate_up_proj and down_proj of two layers
    data = [datum(TOKENS), datum(TOKENS[3:])]
    for _ in range(2):  # the first step moves B off zero, the second gives A a gradient too
        engine.forward_backward("a", data, "cross_entropy")
        engine.optim_step("a", ADAM)
    trained = engine.adapter_weights("a")
    for key in experts:  # every expert tensor trained
        assert np.abs(trained[key] - fresh[key]).max() > 0, key
        a_key = key.replace(".lora_B.", ".lora_A.")
        assert np.abs(trained[a_key] - fresh[a_key]).max() > 0, a_key

    engine.export_adapter("a", tmp_path / "export", with_optimizer=True)
    engine.import_adapter("b", name, tmp_path / "export", with_optimizer=True)
    parts = ("weights", "optimizer")
    assert engine.state_hashes("b", parts) == engine.state_hashes("a", parts)
    for adapter in ("a", "b"):
        engine.forward_backward(adapter, data, "cross_entropy")
        engine.optim_step(adapter, ADAM)
    assert engine.state_hashes("b", parts) == engine.state_hashes("a", parts)

    engine.snapshot("a", "first")
    before = engine.sample(name, "first", TOKENS, 2, PARAMS)
    base = engine.sample(name, None, TOKENS, 2, PARAMS)
    engine.snapshot("b", "second")  # one loaded at most: "first" goes to disk
    assert list(engine.spilled_snapshots()) == ["first"]
    after = engine.sample(name, "first", TOKENS, 2, PARAMS)
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    assert [s.logprobs for s in after.sequences] == [s.logprobs for s in before.sequences]
    assert [s.logprobs for s in base.sequences] != [s.logprobs for s in before.sequences]
