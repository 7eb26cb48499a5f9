"""Base models as torch modules: a registered Hugging Face folder, the tiny debug Llama, and
SmolLM2 (from its GGUF, cached).

A registered model loads with `AutoModelForCausalLM.from_pretrained(folder)` (a vision-language
model with `AutoModelForImageTextToText`'s class), offline, in the
engine's dtype unless its entry names one (on CUDA; the CPU always runs float32), its attention
pinned (`determinism.attention_implementation`: SDPA where the class has it, else eager). Owns the model
cache `<cache_dir>/models/<safe name>/` (safetensors written once from the
dequantised GGUF; later loads read it directly). Returns frozen models in eval mode; LoRA is the
engine's business. Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from treadle.engine.models import determinism
from treadle.engine.models.weight_files import WeightFiles, build_deferred
from treadle.platform.errors import ValidationError
from treadle.platform.models.catalog import BaseModelInfo, get_base_model, gguf_path
from treadle.platform.models.tokenizers import load_tokenizer, safe_name, tokenizer_dir

__all__ = [
    "TINY_DEBUG_SEED",
    "build_tiny_debug",
    "load_base_model",
    "load_deferred",
    "model_dir",
    "serving_dir",
    "tiny_debug_config",
]

TINY_DEBUG_SEED = 0


def load_base_model(
    base: str | BaseModelInfo,
    cache_dir: Path,
    device: str | torch.device,
    dtype: torch.dtype,
    *,
    on_host: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base model (a registry entry, or a built-in's name) on `device` in `dtype`, frozen,
    with its tokenizer. With `on_host`, in the dtype `device` would get but left in host memory:
    a worker group that shards the model moves each rank's share to its device itself, so no
    device ever holds the whole model.

    Raises ValidationError for an unknown built-in name.
    """
    info = base if isinstance(base, BaseModelInfo) else get_base_model(base)
    tokenizer = load_tokenizer(info, cache_dir)
    model: PreTrainedModel
    if info.kind == "hf":
        assert info.path is not None, info
        dtype = _registered_dtype(info, device, dtype)
        model = _from_pretrained(info.path, dtype=dtype, local_files_only=True)
    elif info.kind == "tiny-debug":
        model = build_tiny_debug(tokenizer)
    else:
        model = _from_pretrained(str(model_dir(info, cache_dir)), dtype=dtype)
    model.to(device="cpu" if on_host else device, dtype=dtype)  # type: ignore[call-arg]
    _vocab_size_on_top(model)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def load_deferred(
    base: str | BaseModelInfo, cache_dir: Path, device: str | torch.device, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, WeightFiles | None]:
    """The base model as a sharded worker group loads it: its parameters left on the meta
    device, with where to read them (`weight_files`), so that each rank reads one decoder layer
    at a time and keeps only its shard; or whole in host memory, with None, where its files do
    not allow that (the tiny debug model; a checkpoint transformers converts while loading).
    In the dtype `device` would get, frozen, with its tokenizer."""
    info = base if isinstance(base, BaseModelInfo) else get_base_model(base)
    if info.kind == "tiny-debug":
        model, tokenizer = load_base_model(info, cache_dir, device, dtype, on_host=True)
        return model, tokenizer, None
    tokenizer = load_tokenizer(info, cache_dir)
    if info.kind == "hf":
        assert info.path is not None, info
        folder, dtype = Path(info.path), _registered_dtype(info, device, dtype)
    else:
        folder = model_dir(info, cache_dir)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    attention = determinism.attention_implementation(_model_class(config))
    model, files = build_deferred(folder, dtype, attention, config)
    return model, tokenizer, files


def _from_pretrained(folder: str, **kwargs: Any) -> PreTrainedModel:
    """The folder's causal LM with its attention pinned (`determinism.attention_implementation`),
    not left to what transformers finds installed."""
    config = AutoConfig.from_pretrained(folder, local_files_only=kwargs.get("local_files_only"))
    model_class = _model_class(config)
    attention = determinism.attention_implementation(model_class)
    return model_class.from_pretrained(  # type: ignore[no-any-return]
        folder, attn_implementation=attention, **kwargs
    )


def _vocab_size_on_top(model: PreTrainedModel) -> None:
    """A vision-language model's config keeps its vocabulary in `text_config`; the engine reads
    `config.vocab_size` (the output layer's width) as a causal LM's has it."""
    text = model.config.get_text_config(decoder=True)
    if text is not model.config and "vocab_size" not in model.config.__dict__:
        model.config.vocab_size = text.vocab_size


def _model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The class AutoModelForCausalLM builds for `config`; for a vision-language model's,
    AutoModelForImageTextToText's (registration admitted only those: `platform.models.vision`)."""
    table = MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) not in table and getattr(config, "vision_config", None) is not None:
        table = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    model_class: type[PreTrainedModel] = table[type(config)]  # type: ignore[assignment]
    return model_class


def _registered_dtype(
    info: BaseModelInfo, device: str | torch.device, default: torch.dtype
) -> torch.dtype:
    """The entry's dtype where it names one and the device is an accelerator; else `default`
    (float32 on the CPU, whose bfloat16 kernels are slow and whose results tests compare)."""
    if info.dtype == "auto" or torch.device(device).type == "cpu":
        return default
    return getattr(torch, info.dtype)  # type: ignore[no-any-return]


def build_tiny_debug(tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights from a fixed seed, bit-identical in every process.

    Built in float32 on the CPU (whatever the target device) inside a forked RNG, so the global
    RNG is left untouched.
    """
    config = tiny_debug_config(
        len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=determinism.attention_implementation(LlamaForCausalLM),  # type: ignore[call-arg]
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_DEBUG_SEED)
        model = LlamaForCausalLM(config)
    model.float()
    return model


def tiny_debug_config(vocab_size: int, **token_ids: Any) -> LlamaConfig:
    """The tiny debug Llama's config for a `vocab_size` vocabulary (and special `token_ids`)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **token_ids,
    )


def model_dir(info: BaseModelInfo, cache_dir: Path) -> Path:
    """The safetensors folder of a GGUF model (a built-in or a registered one), converting its
    own GGUF file on first use."""
    folder = Path(cache_dir) / "models" / safe_name(info.name)
    if not (folder / "config.json").is_file():
        _convert_gguf(folder, info)
    return folder


def serving_dir(info: BaseModelInfo, cache_dir: Path) -> Path:
    """A folder an inference server (vLLM) loads the model from, its tokenizer beside its
    weights: a registered folder itself (it has both), else `<cache_dir>/serving/<name>/`
    linking the cached safetensors folder's files and the tokenizer's."""
    if info.kind == "hf":
        assert info.path is not None, info
        return Path(info.path)
    if info.kind == "tiny-debug":
        raise ValidationError(
            f"{info.name} is built in code and has no files an inference server can load; "
            "sample it on a worker with the reference sampler, or register a model folder"
        )
    folder = Path(cache_dir) / "serving" / safe_name(info.name)
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for source in (tokenizer_dir(info, cache_dir), model_dir(info, cache_dir)):
        for file in source.iterdir():
            link = folder / file.name
            if file.is_file() and not link.exists():
                with contextlib.suppress(FileExistsError):  # another process made it
                    link.symlink_to(file.resolve())
    return folder


def _convert_gguf(folder: Path, info: BaseModelInfo) -> None:
    """Dequantise `info`'s own GGUF file into float32 safetensors under `folder`, atomically:
    racing processes each write a private temporary folder and the first rename wins."""
    gguf = gguf_path(info)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are already dequantised; forget the GGUF "quantisation" so they serialise.
        setattr(model, "hf_quantizer", None)  # noqa: B010  # the attribute is typed as a module
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
