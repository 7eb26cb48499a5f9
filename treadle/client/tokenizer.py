"""Tokenizers served by the platform: fetched once, cached on disk, loaded with transformers.

No hub access: the server sends the tokenizer files of each base model.
Imports nothing from the server side.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx


def cache_root() -> Path:
    return (
        Path(os.environ.get("TREADLE_CACHE_DIR") or Path.home() / ".cache" / "treadle") / "client"
    )


def fetch_tokenizer(base_url: str, api_key: str, base_model: str) -> Any:
    """The base model's tokenizer (a transformers PreTrainedTokenizerFast)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_folder(base_url, api_key, base_model)))


def fetch_image_processor(base_url: str, api_key: str, base_model: str) -> Any:
    """A vision-language base model's image processor (saved beside its tokenizer: the server
    sends its `preprocessor_config.json` with the tokenizer's files)."""
    from transformers import AutoImageProcessor

    folder = tokenizer_folder(base_url, api_key, base_model)
    if not (folder / "preprocessor_config.json").is_file():
        raise ValueError(f"{base_model} has no image processor: it is not a vision-language model")
    return AutoImageProcessor.from_pretrained(str(folder))


def tokenizer_folder(base_url: str, api_key: str, base_model: str) -> Path:
    """The folder of the base model's tokenizer files, fetched once into the client cache."""
    key = hashlib.sha256(f"{base_url}|{base_model}".encode()).hexdigest()[:16]
    folder = cache_root() / "tokenizers" / key
    if not (folder / "tokenizer.json").exists():
        response = httpx.get(
            f"{base_url}/api/v1/treadle/tokenizer",
            params={"base_model": base_model},
            headers={"X-API-Key": api_key},
            timeout=120,
        )
        response.raise_for_status()
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent))
        for name, content in response.json()["files"].items():
            (tmp / Path(name).name).write_bytes(base64.b64decode(content))
        try:
            tmp.rename(folder)
        except OSError:  # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
