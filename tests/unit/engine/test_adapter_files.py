"""Adapter and merged-model files: exact resume, peft and transformers compatibility, snapshots
from files, and what `import_adapter` rejects (tiny debug model, CPU)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import (
    DATA,
    LORA,
    PROMPT,
    TINY,
    logprobs,
    new_adapter,
    train,
)

from treadle.engine import Engine, EngineDatum, LoraSpec, SamplingSpec
from treadle.engine.lora import files as adapter_files
from treadle.engine.models import loading as models
from treadle.platform.errors import ConflictError, ValidationError
from treadle.platform.models.catalog import SMOLLM2_NAME

ALL_PARTS = LoraSpec(rank=4, alpha=8.0, seed=5, train_attn=True, train_mlp=True)


@pytest.fixture(scope="module")
def trained(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """An adapter (attn, mlp and unembed) trained 3 steps, exported with its optimizer."""
    adapter = new_adapter(engine, ALL_PARTS)
    train(engine, adapter, 3)
    folder = tmp_path_factory.mktemp("trained")
    engine.export_adapter(adapter, folder, with_optimizer=True)
    return adapter, folder


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def assert_same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def model_logprobs(model: torch.nn.Module, data: Sequence[EngineDatum]) -> list[np.ndarray]:
    out = []
    with torch.no_grad():
        for datum in data:
            logits_T_V = model(input_ids=torch.tensor([datum.tokens])).logits[0].float()
            targets_T = torch.from_numpy(np.asarray(datum.loss_fn_inputs["target_tokens"]))
            lp = torch.log_softmax(logits_T_V, -1).gather(-1, targets_T[:, None])[:, 0]
            out.append(lp.numpy())
    return out


# -- the adapter folder --------------------------------------------------------------------------


def test_folder_is_a_peft_adapter(engine: Engine, trained: tuple[str, Path]) -> None:
    adapter, folder = trained
    assert {p.name for p in folder.iterdir()} == {
        "adapter_model.safetensors",
        "adapter_config.json",
        "treadle.json",
        "optimizer.safetensors",
    }
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["base_model_name_or_path"] == TINY
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    )
    treadle = json.loads((folder / "treadle.json").read_text())
    assert treadle["base_model"] == TINY
    assert treadle["lora"] == {
        "rank": 4,
        "alpha": 8.0,
        "seed": 5,
        "train_attn": True,
        "train_mlp": True,
        "train_unembed": True,
    }
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in names
    assert "base_model.model.lm_head.lora_A.weight" in names
    assert names == set(engine.adapter_weights(adapter))


def test_resume_with_optimizer_is_bit_identical(engine: Engine, tmp_path: Path) -> None:
    original = new_adapter(engine, LORA)
    train(engine, original, 3)
    engine.export_adapter(original, tmp_path, with_optimizer=True)
    at_export = engine.adapter_weights(original)
    train(engine, original, 2)
    w5 = engine.adapter_weights(original)

    resumed = "resumed-with-optimizer"
    engine.import_adapter(resumed, TINY, tmp_path, with_optimizer=True)
    assert_same_weights(engine.adapter_weights(resumed), at_export)
    train(engine, resumed, 2)
    assert_same_weights(engine.adapter_weights(resumed), w5)

    fresh = "resumed-without-optimizer"
    engine.import_adapter(fresh, TINY, tmp_path, with_optimizer=False)
    assert_same_weights(engine.adapter_weights(fresh), at_export)
    train(engine, fresh, 2)
    after = engine.adapter_weights(fresh)
    assert any(not np.array_equal(after[n], w5[n]) for n in w5)  # Adam restarted from step 0
    # ... and it matches an adapter given the same weights and a brand-new optimizer.
    control = new_adapter(engine, LORA)
    engine.set_adapter_weights(control, at_export)
    train(engine, control, 2)
    assert_same_weights(engine.adapter_weights(control), after)


def test_export_before_any_step_resumes(engine: Engine, tmp_path: Path) -> None:
    original = new_adapter(engine, LORA)
    engine.export_adapter(original, tmp_path, with_optimizer=True)
    engine.import_adapter("never-stepped", TINY, tmp_path, with_optimizer=True)
    train(engine, original, 1)
    train(engine, "never-stepped", 1)
    assert_same_weights(engine.adapter_weights("never-stepped"), engine.adapter_weights(original))


def test_plain_peft_folder_imports(
    engine: Engine, trained: tuple[str, Path], tmp_path: Path
) -> None:
    adapter, folder = trained
    folder = copy_of(folder, tmp_path)
    (folder / "treadle.json").unlink()
    engine.import_adapter("from-peft-config", TINY, folder, with_optimizer=False)
    assert_same_weights(engine.adapter_weights("from-peft-config"), engine.adapter_weights(adapter))


# -- compatibility -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")
def test_peft_loads_the_adapter(engine: Engine, trained: tuple[str, Path]) -> None:
    from peft import PeftModel

    adapter, folder = trained
    base, _ = models.load_base_model(TINY, engine.cache_dir, "cpu", torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    expected = logprobs(engine, adapter, DATA)
    for got, want in zip(model_logprobs(peft_model, DATA), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    with peft_model.disable_adapter():  # the adapter really changes the output
        assert not np.allclose(model_logprobs(peft_model, DATA[:1])[0], expected[0], atol=1e-3)


@pytest.mark.parametrize("train_unembed", [True, False])
def test_merged_model_loads_with_transformers_alone(
    engine: Engine, tmp_path: Path, train_unembed: bool
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = new_adapter(engine, LoraSpec(rank=4, alpha=8.0, seed=9, train_unembed=train_unembed))
    train(engine, adapter, 3)
    engine.export_merged(adapter, tmp_path)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert merged.dtype == torch.float32
    assert merged.config.tie_word_embeddings is (not train_unembed)
    base, _ = models.load_base_model(TINY, engine.cache_dir, "cpu", torch.float32)
    embed = merged.get_input_embeddings().weight
    assert torch.equal(embed, base.state_dict()["model.embed_tokens.weight"])  # never merged into
    assert (merged.lm_head.weight is embed) is (not train_unembed)
    for got, want in zip(
        model_logprobs(merged, DATA), logprobs(engine, adapter, DATA), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Hello, merged world!"
    assert tokenizer(text)["input_ids"] == engine.tokenizer(TINY)(text)["input_ids"]


def test_snapshot_from_files_samples_like_the_live_adapter(
    engine: Engine, trained: tuple[str, Path]
) -> None:
    adapter, folder = trained  # not trained since the export
    engine.snapshot(adapter, "live-snapshot")
    engine.load_snapshot("file-snapshot", TINY, folder)
    engine.load_snapshot("file-snapshot", TINY, folder)  # replacing is fine
    greedy = SamplingSpec(max_tokens=12, temperature=0.0, stop=())
    want = engine.sample(TINY, "live-snapshot", PROMPT, 1, greedy).sequences[0].tokens
    got = engine.sample(TINY, "file-snapshot", PROMPT, 1, greedy).sequences[0].tokens
    assert got == want
    base = engine.sample(TINY, None, PROMPT, 1, greedy).sequences[0].tokens
    assert got != base  # the trained adapter changes what is sampled
    engine.drop_snapshot("file-snapshot")
    assert not engine.has_snapshot("file-snapshot")


# -- rejections ----------------------------------------------------------------------------------


def test_import_rejects_another_base_model(
    engine: Engine, trained: tuple[str, Path], tmp_path: Path
) -> None:
    _, folder = trained
    with pytest.raises(ValidationError, match="base model"):
        engine.import_adapter("wrong-base", SMOLLM2_NAME, folder, with_optimizer=False)
    with pytest.raises(ValidationError, match="base model"):
        engine.load_snapshot("wrong-base", SMOLLM2_NAME, folder)
    folder = copy_of(folder, tmp_path)
    (folder / "treadle.json").unlink()
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = SMOLLM2_NAME
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValidationError, match="base model"):
        engine.import_adapter("wrong-base", TINY, folder, with_optimizer=False)
    assert not engine.has_adapter("wrong-base") and not engine.has_snapshot("wrong-base")


@pytest.mark.parametrize(
    ("remove", "with_optimizer", "word"),
    [
        (["adapter_model.safetensors"], False, "adapter_model.safetensors"),
        (["treadle.json", "adapter_config.json"], False, "adapter_config.json"),
        (["optimizer.safetensors"], True, "optimizer"),
    ],
)
def test_import_rejects_missing_files(
    engine: Engine,
    trained: tuple[str, Path],
    tmp_path: Path,
    remove: list[str],
    with_optimizer: bool,
    word: str,
) -> None:
    folder = copy_of(trained[1], tmp_path)
    for name in remove:
        (folder / name).unlink()
    with pytest.raises(ValidationError, match=word):
        engine.import_adapter("missing", TINY, folder, with_optimizer=with_optimizer)
    assert not engine.has_adapter("missing")


def test_import_rejects_mismatched_or_corrupt_files(
    engine: Engine, trained: tuple[str, Path], tmp_path: Path
) -> None:
    folder = copy_of(trained[1], tmp_path)
    treadle = json.loads((folder / "treadle.json").read_text())
    treadle["lora"]["rank"] = 8
    (folder / "treadle.json").write_text(json.dumps(treadle))
    with pytest.raises(ValidationError, match="shape"):
        engine.import_adapter("bad", TINY, folder, with_optimizer=True)
    treadle["lora"]["rank"] = 4
    treadle["lora"]["train_unembed"] = False
    (folder / "treadle.json").write_text(json.dumps(treadle))
    with pytest.raises(ValidationError, match="lm_head"):
        engine.import_adapter("bad", TINY, folder, with_optimizer=False)
    treadle["lora"]["rank"] = "4"
    (folder / "treadle.json").write_text(json.dumps(treadle))
    with pytest.raises(ValidationError, match="malformed"):
        engine.import_adapter("bad", TINY, folder, with_optimizer=False)
    (folder / "treadle.json").write_text("{not json")
    with pytest.raises(ValidationError, match="treadle.json"):
        engine.import_adapter("bad", TINY, folder, with_optimizer=False)
    (folder / "treadle.json").unlink()
    (folder / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValidationError, match="adapter_model.safetensors"):
        engine.import_adapter("bad", TINY, folder, with_optimizer=False)
    assert not engine.has_adapter("bad")


def test_import_onto_an_existing_adapter_conflicts(
    engine: Engine, trained: tuple[str, Path]
) -> None:
    adapter, folder = trained
    before = engine.weight_hash(adapter)
    with pytest.raises(ConflictError):
        engine.import_adapter(adapter, TINY, folder, with_optimizer=True)
    assert engine.weight_hash(adapter) == before


def test_optimizer_file_layout(trained: tuple[str, Path]) -> None:
    saved = adapter_files.read_adapter(trained[1], TINY, with_optimizer=True)
    assert saved.optimizer is not None and set(saved.optimizer) == set(saved.tensors)
    for name, state in saved.optimizer.items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == 3.0
        assert tuple(state["exp_avg"].shape) == saved.tensors[name].shape
