"""Admission by structure (platform/models/structure.py through model_files.inspect_folder): tiny
random models of real architectures saved with `save_pretrained` register when transformers
builds them, their layers are ones the sampler caches and every linear of their decoder layers
resolves under the LoRA target rules; otherwise the refusal names the layer types, config keys
or modules that did not resolve. No list of architecture names is involved."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import architectures, tiny_models
from treadle.platform.errors import ValidationError
from treadle.platform.models import model_files

ADMITTED = architectures.ARCHITECTURES  # the eight once listed by name, and BY_STRUCTURE


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("structure")
    return {
        arch: tiny_models.model_folder(arch, root / arch)
        for arch in (*ADMITTED, *architectures.REFUSED)
    }


def inspect(folder: Path, **options: Any) -> Any:
    return model_files.inspect_folder("org/m", folder, model_files.Options(**options))


def edited(
    folders: dict[str, Path], tmp_path: Path, arch: str, edit: Callable[[dict], None]
) -> Path:
    """A copy of `arch`'s folder with its config.json changed by `edit`."""
    folder = tmp_path / f"{arch}-edited"
    shutil.copytree(folders[arch], folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("arch", ADMITTED)
def test_a_decoder_only_model_with_resolvable_blocks_registers(
    folders: dict[str, Path], arch: str
) -> None:
    info = inspect(folders[arch])
    assert info.architecture == architectures.build(arch).__class__.__name__
    assert info.moe_experts == (arch in architectures.MOE)
    assert info.lora_targets == ("attn", "mlp", "unembed")  # MoE experts are adapted too


def test_the_four_outside_the_old_list_are_new_architectures() -> None:
    old = {"llama3", "qwen2.5", "qwen3", "qwen3-moe", "mistral", "gemma3", "phi3", "gpt-oss"}
    assert set(architectures.BY_STRUCTURE) <= set(ADMITTED) - old
    assert len(architectures.BY_STRUCTURE) >= 4


def test_mlp_linears_with_unknown_names_are_refused_by_name(folders: dict[str, Path]) -> None:
    with pytest.raises(ValidationError) as refused:
        inspect(folders["starcoder2"])
    message = str(refused.value)
    assert "Starcoder2ForCausalLM" in message
    assert "MLP linears the LoRA target rules do not know" in message
    assert "model.layers.*.mlp.c_fc" in message and "model.layers.*.mlp.c_proj" in message
    assert "self_attn" not in message  # its attention resolves


def test_unknown_mlp_names_register_when_the_policy_leaves_mlp_out(
    folders: dict[str, Path],
) -> None:
    """The operator may register it for attention and unembedding only: sessions asking for the
    MLP are refused at creation, so the unknown linears are never left untrained silently."""
    info = inspect(folders["starcoder2"], lora_targets=("attn", "unembed"))
    assert info.lora_targets == ("attn", "unembed")
    with pytest.raises(ValidationError, match="train_mlp=False"):
        info.check_lora(4, True, True, True)


def test_linear_attention_layers_are_refused_by_type_and_module(folders: dict[str, Path]) -> None:
    with pytest.raises(ValidationError) as refused:
        inspect(folders["qwen3-next"])
    message = str(refused.value)
    assert "layer 0 is linear_attention" in message
    assert "linears outside any attention or MLP block" in message
    assert "model.layers.*.linear_attn.in_proj_qkvz" in message
    assert "model.layers.*.linear_attn.conv1d" in message


def test_a_mamba_hybrid_is_refused_by_its_keys_and_modules(folders: dict[str, Path]) -> None:
    """Falcon-H1 declares no layer_types: its Mamba mixers show in config.json's keys and in
    the weights of its layers."""
    with pytest.raises(ValidationError) as refused:
        inspect(folders["falcon-h1"])
    message = str(refused.value)
    assert "config.json describes recurrent layers (mamba_chunk_size" in message
    assert "model.layers.*.mamba.in_proj" in message and "model.layers.*.mamba.conv1d" in message


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(layer_types=["full_attention", "mamba"]), "layer 1 is mamba"),
        (lambda c: c.update(layer_types=None, attention_chunk_size=8), "chunked_attention"),
        (lambda c: c.update(kv_sharing_modes=["own", "reuse"]), "reuse another layer's KV"),
        (
            lambda c: c.update(architectures=["FalconH1ForCausalLM"]),
            "builds Qwen3ForCausalLM for its model_type 'qwen3'",
        ),
        (lambda c: c.update(model_type="no_such_lm"), "no causal LM for model_type 'no_such_lm'"),
    ],
    ids=["mamba-layer", "chunked", "kv-sharing", "other-class", "unknown-type"],
)
def test_config_json_that_transformers_or_the_sampler_cannot_serve_is_refused(
    folders: dict[str, Path], tmp_path: Path, edit: Callable[[dict], None], match: str
) -> None:
    with pytest.raises(ValidationError, match=match):
        inspect(edited(folders, tmp_path, "qwen3", edit))


def test_the_inspection_reads_transformers_table_without_importing_it(
    folders: dict[str, Path],
) -> None:
    """Registration runs in the API process, which never imports torch or transformers: the
    structure check parses transformers' causal-LM table from its source."""
    code = (
        "import sys; from pathlib import Path; from treadle.platform.models import model_files; "
        f"info = model_files.inspect_folder('o/m', Path({str(folders['olmo2'])!r}), "
        "model_files.Options()); print(info.architecture); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Olmo2ForCausalLM", "[]"]


def test_without_transformers_the_structure_check_still_runs(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An API process without transformers cannot read its table (the workers' load checks
    that); the layer types and the target rules are still checked."""
    from treadle.platform.models import structure

    monkeypatch.setattr(structure.importlib.util, "find_spec", lambda name: None)
    structure.causal_lm_classes.cache_clear()
    try:
        assert structure.causal_lm_classes() is None
        assert inspect(folders["olmo2"]).architecture == "Olmo2ForCausalLM"
        with pytest.raises(ValidationError, match=re.escape("model.layers.*.mlp.c_fc")):
            inspect(folders["starcoder2"])
    finally:
        structure.causal_lm_classes.cache_clear()
