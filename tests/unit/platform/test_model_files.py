"""What a model folder says about itself (platform/models/model_files.py), read without torch:
the entry the registry records, a SentencePiece-only tokenizer, and a hub id at a pinned
revision resolved from a Hugging Face cache laid out as huggingface_hub writes it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import tiny_models
from treadle.platform.errors import ValidationError
from treadle.platform.models import model_files, registry, tokenizers

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.model_folder("mistral", tmp_path_factory.mktemp("m") / "mistral")


def test_the_entry_holds_what_the_files_say(mistral: Path) -> None:
    info = model_files.inspect_folder("org/mistral", mistral, model_files.Options(max_lora_rank=8))
    assert info.kind == "hf" and info.architecture == "MistralForCausalLM"
    assert info.sliding_window == 16 and info.max_context_length == 512
    assert info.vocab_size == 320 and info.tokenizer_vocab_size == 320
    assert info.eos_token_ids == (2,) and info.has_chat_template and info.max_lora_rank == 8
    assert info.size_bytes == 4 * info.parameters > 0
    assert tokenizers.tokenizer_file_names(mistral) == [
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja",
        "generation_config.json", "config.json",
    ]  # fmt: skip


def test_a_sentencepiece_only_tokenizer_is_measured_with_sentencepiece(
    mistral: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "sp-only"
    shutil.copytree(mistral, folder)
    (folder / "tokenizer.json").unlink()
    info = model_files.inspect_folder("org/sp", folder, model_files.Options())
    assert info.tokenizer_vocab_size == 320
    (folder / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(ValidationError, match="not a SentencePiece model"):
        model_files.inspect_folder("org/sp", folder, model_files.Options())


def test_operator_options_are_checked(mistral: Path) -> None:
    with pytest.raises(ValidationError, match="max_context_length is 4096"):
        model_files.inspect_folder("o/m", mistral, model_files.Options(max_context_length=4096))
    with pytest.raises(ValidationError, match="lora_targets"):
        model_files.inspect_folder("o/m", mistral, model_files.Options(lora_targets=("ffn",)))
    with pytest.raises(ValidationError, match="dtype 'int8'"):
        model_files.inspect_folder("o/m", mistral, model_files.Options(dtype="int8"))


def test_a_hub_id_resolves_from_the_local_cache_at_its_pinned_revision(
    mistral: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--acme--tiny-mistral"
    shutil.copytree(mistral, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    assert registry.resolve_hub_folder("acme/tiny-mistral", "main").name == COMMIT
    assert registry.resolve_hub_folder("acme/tiny-mistral", COMMIT).name == COMMIT
    with pytest.raises(ValidationError, match="hf download acme/tiny-mistral --revision v2"):
        registry.resolve_hub_folder("acme/tiny-mistral", "v2")
    with pytest.raises(ValidationError, match="needs a pinned revision"):
        registry.resolve_hub_folder("acme/tiny-mistral", None)


def test_the_inspection_imports_neither_torch_nor_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import treadle.platform.models.registry; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
