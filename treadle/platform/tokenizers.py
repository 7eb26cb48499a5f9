"""Tokenizer files for catalogue models, built once from the SmolLM2 GGUF and cached on disk.

Owns the on-disk tokenizer cache (`<cache_dir>/tokenizers/<safe name>/`). The files are a Hugging
Face fast tokenizer (tokenizer.json, tokenizer_config.json, chat template, ...) so clients can load
them with `AutoTokenizer.from_pretrained(folder)`.
Must not import torch (the API process serves these files without it); transformers is imported
lazily, and only `PreTrainedTokenizerFast` (which does not pull torch in) when loading.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from treadle.platform.catalog import get_base_model, smollm2_gguf_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["load_tokenizer", "safe_name", "tokenizer_dir", "tokenizer_files"]


def safe_name(model_name: str) -> str:
    """A folder name for `model_name` ("HuggingFaceTB/SmolLM2" -> "HuggingFaceTB--SmolLM2")."""
    return model_name.replace("/", "--")


def tokenizer_dir(base_model: str, cache_dir: Path) -> Path:
    """The cached tokenizer folder of `base_model`, building it first if needed."""
    source = get_base_model(base_model).tokenizer_source
    folder = Path(cache_dir) / "tokenizers" / safe_name(source)
    if not (folder / "tokenizer.json").is_file():
        _build(folder)
    return folder


def tokenizer_files(base_model: str, cache_dir: Path) -> dict[str, bytes]:
    """Every file of `base_model`'s fast tokenizer, by file name.

    Raises ValidationError for an unknown base model.
    """
    folder = tokenizer_dir(base_model, cache_dir)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def load_tokenizer(base_model: str, cache_dir: Path) -> PreTrainedTokenizerFast:
    """`base_model`'s tokenizer, loaded from the cache folder (built on first use)."""
    from transformers import PreTrainedTokenizerFast

    folder = tokenizer_dir(base_model, cache_dir)
    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tokenizer


def _build(folder: Path) -> None:
    """Convert the GGUF tokenizer into `folder`, atomically: racing processes each build in a
    private temporary folder and the first rename wins."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(str(tmp))
        _make_portable(tmp / "tokenizer_config.json")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
        _publish(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_portable(config_path: Path) -> None:
    """Name a class transformers 4.x also knows, inline the chat template and drop machine-local
    loading flags, so clients with older transformers load the files too."""
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    template = config_path.parent / "chat_template.jinja"
    if template.is_file():  # transformers < 4.43 reads the template only from the config
        config["chat_template"] = template.read_text()
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, folder: Path) -> None:
    """Rename `tmp` to `folder` unless another process already published it."""
    try:
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "tokenizer.json").is_file():
            raise
