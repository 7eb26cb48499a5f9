"""What a Hugging Face causal LM folder says about itself, read without torch or transformers.

Owns `inspect_folder`: from `config.json` (architecture, context length, vocabulary, tied
embeddings, sliding window, quantisation), the tokenizer (`tokenizer.json`, or a SentencePiece
`tokenizer.model`), the chat template (`tokenizer_config.json` or `chat_template.jinja`),
`generation_config.json` (end-of-sequence ids), a vision-language model's
`preprocessor_config.json` (`vision.vision_spec`) and the safetensors headers (parameter count,
bytes, and each tensor's name and shape, from which `structure` decides admission) it builds the
`BaseModelInfo` the registry records, or refuses the folder with a ValidationError that says
what is wrong and how to fix it. Imports only the models package's pure modules and the
platform's errors; sentencepiece is imported lazily.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.platform.errors import ValidationError
from treadle.platform.models.catalog import LORA_CATEGORIES, BaseModelInfo
from treadle.platform.models.structure import check_structure
from treadle.platform.models.tokenizers import gguf_metadata, tokenizer_from_gguf
from treadle.platform.models.vision import vision_spec

__all__ = [
    "DTYPES",
    "Options",
    "inspect_folder",
    "inspect_gguf",
]

_ENCODER_SUFFIXES = (
    "ForMaskedLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForConditionalGeneration",
    "Model",
)
DTYPES = ("auto", "float32", "bfloat16", "float16")
_MAX_HEADER = 100 * 2**20  # a safetensors header past this is not one


@dataclass(frozen=True)
class Options:
    """What the operator sets at registration; None takes what the files say."""

    description: str | None = None
    dtype: str = "auto"
    max_lora_rank: int = 128
    lora_targets: tuple[str, ...] = LORA_CATEGORIES
    max_context_length: int | None = None


def inspect_folder(
    name: str,
    folder: Path,
    options: Options,
    *,
    hub_id: str | None = None,
    revision: str | None = None,
) -> BaseModelInfo:
    """The registry entry for the causal LM in `folder`, called `name`.

    Raises ValidationError, naming the file and the fix, for a folder that is missing or
    unreadable, a missing or malformed `config.json`, a model that is not a decoder-only causal
    LM of a structure Treadle trains and samples (`structure.check_structure`: the layer types
    or modules that did not resolve), a quantised checkpoint, no safetensors weights, a missing
    or malformed tokenizer, or a tokenizer larger than the embedding.
    """
    folder = _readable_folder(Path(folder))
    config = _json_file(folder / "config.json", "config.json", required=True)
    assert config is not None  # required: a missing file raised
    architecture = _architecture(config)
    _check_not_quantised(config)
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    vocab_size = _positive_int(text, "vocab_size")
    context = _positive_int(text, "max_position_embeddings")
    parameters, size_bytes, shapes = _weights(folder)
    _targets(options.lora_targets)  # the policy is valid before structure reads it
    structure = check_structure(architecture, config, shapes, options.lora_targets)
    tokenizer_vocab = _tokenizer_vocab_size(folder)
    if tokenizer_vocab > vocab_size:
        raise ValidationError(
            f"the tokenizer has {tokenizer_vocab} tokens but config.json's vocab_size is "
            f"{vocab_size}: token ids past the embedding would fail; register the tokenizer that "
            "was trained with this model (or resize the embedding and save the model again)"
        )
    tok_config = _json_file(folder / "tokenizer_config.json", "tokenizer_config.json") or {}
    has_template = bool(tok_config.get("chat_template")) or any(
        (folder / f).is_file() for f in ("chat_template.jinja", "chat_template.json")
    )
    generation = _json_file(folder / "generation_config.json", "generation_config.json") or {}
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
    moe = structure.moe_experts
    targets = _targets(options.lora_targets)
    dtype, max_rank = _dtype(options), _rank(options)
    context = _context(options, context, "config.json's max_position_embeddings")
    sliding = text.get("sliding_window")
    vision = None
    if isinstance(config.get("vision_config"), dict):
        preprocessor = _json_file(folder / "preprocessor_config.json", "preprocessor_config.json")
        vision = vision_spec(str(config.get("model_type", "")), config, preprocessor)
    return BaseModelInfo(
        name=name,
        kind="hf",
        max_context_length=context,
        tokenizer_source=name,
        vocab_size=vocab_size,
        description=options.description
        or f"{architecture} ({_human(parameters)} parameters) from {hub_id or folder}",
        path=str(folder),
        hub_id=hub_id,
        revision=revision,
        architecture=architecture,
        model_type=str(config.get("model_type", "")),
        dtype=dtype,
        max_lora_rank=max_rank,
        lora_targets=targets,
        moe_experts=moe,
        tied_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings"))),
        sliding_window=int(sliding) if isinstance(sliding, int) and sliding > 0 else None,
        eos_token_ids=eos_ids,
        parameters=parameters,
        size_bytes=size_bytes,
        tokenizer_vocab_size=tokenizer_vocab,
        has_chat_template=has_template,
        vision=vision,
    )


# GGUF's `general.architecture` -> the transformers class its conversion builds.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def inspect_gguf(name: str, folder: Path, gguf_file: str, options: Options) -> BaseModelInfo:
    """The registry entry for the GGUF file `gguf_file` in `folder`, called `name`: converted
    once to float32 safetensors by each worker that loads it, its tokenizer built from the
    file's own metadata. ValidationError for a file that is missing, not GGUF, of an
    architecture transformers cannot convert, or with a tokenizer Treadle cannot build."""
    folder = _readable_folder(Path(folder))
    if "/" in gguf_file or gguf_file in ("", ".", ".."):
        raise ValidationError(f"gguf_file {gguf_file!r} must be a file name inside the folder")
    path = folder / gguf_file
    if not path.is_file():
        raise ValidationError(f"{folder} has no file {gguf_file!r}")
    try:
        metadata = gguf_metadata(path)
    except Exception as exc:  # noqa: BLE001  # the reader raises many kinds on a bad file
        raise ValidationError(f"{gguf_file} is not a readable GGUF file ({exc})") from None
    arch = str(metadata.get("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise ValidationError(
            f"{gguf_file} is a {arch!r} GGUF; Treadle converts {sorted(GGUF_ARCHITECTURES)}"
        )
    try:
        tokenizer_from_gguf(metadata)
    except (ValueError, KeyError) as exc:
        raise ValidationError(f"{gguf_file}'s tokenizer cannot be converted: {exc}") from None
    tokens = len(metadata["tokenizer.ggml.tokens"])
    vocab = int(metadata.get(f"{arch}.vocab_size", tokens))
    context = int(metadata.get(f"{arch}.context_length", 2048))
    context = _context(options, context, "the file's context length")
    parameters = int(metadata["parameters"])
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return BaseModelInfo(
        name=name,
        kind="gguf",
        max_context_length=context,
        tokenizer_source=name,
        vocab_size=vocab,
        description=options.description
        or f"{GGUF_ARCHITECTURES[arch]} ({_human(parameters)} parameters) from {path}",
        gguf_file=gguf_file,
        path=str(folder),
        architecture=GGUF_ARCHITECTURES[arch],
        model_type=arch,
        dtype=_dtype(options),
        max_lora_rank=_rank(options),
        lora_targets=_targets(options.lora_targets),
        eos_token_ids=() if eos is None else (int(eos),),
        parameters=parameters,
        size_bytes=4 * parameters,  # dequantised to float32 once, as the workers hold it
        tokenizer_vocab_size=tokens,
        has_chat_template=bool(metadata.get("tokenizer.chat_template")),
    )


def _readable_folder(folder: Path) -> Path:
    if not folder.is_absolute():
        raise ValidationError(f"path {str(folder)!r} is relative; give the folder's absolute path")
    if not folder.is_dir() or not os.access(folder, os.R_OK | os.X_OK):
        raise ValidationError(
            f"{folder} is not a folder this API process can read; give the absolute path of a "
            "Hugging Face model folder (config.json, tokenizer, *.safetensors) readable here "
            "and on the workers"
        )
    return folder


def _context(options: Options, context: int, source: str) -> int:
    """The operator's max_context_length, within the model's own (`source` says where from)."""
    wanted = options.max_context_length
    if wanted is None:
        return context
    if not 1 <= wanted <= context:
        raise ValidationError(
            f"max_context_length is {wanted}; it must be in [1, {context}] ({source})"
        )
    return wanted


def _dtype(options: Options) -> str:
    if options.dtype not in DTYPES:
        raise ValidationError(f"dtype {options.dtype!r} is unknown; use one of {list(DTYPES)}")
    return options.dtype


def _rank(options: Options) -> int:
    if not 1 <= options.max_lora_rank <= 1024:
        raise ValidationError(f"max_lora_rank is {options.max_lora_rank}; it must be in [1, 1024]")
    return options.max_lora_rank


def _json_file(path: Path, what: str, *, required: bool = False) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ValidationError(
                f"{path.parent} has no {what}; a Hugging Face model folder needs one "
                "(save the model with save_pretrained)"
            )
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValidationError(
            f"{what} in {path.parent} is not valid JSON ({exc}); fix the file"
        ) from None
    if not isinstance(value, dict):
        raise ValidationError(f"{what} in {path.parent} is not a JSON object; fix the file")
    return value


def _architecture(config: dict[str, Any]) -> str:
    found = config.get("architectures")
    if not isinstance(found, list) or not found or not isinstance(found[0], str):
        raise ValidationError(
            "config.json names no architecture (its 'architectures' list is missing or empty); "
            "save the model with save_pretrained, which writes it"
        )
    architecture = found[0]
    if isinstance(config.get("vision_config"), dict):
        return architecture  # a vision-language model: `structure` checks transformers builds it
    if not architecture.endswith("ForCausalLM") and architecture.endswith(_ENCODER_SUFFIXES):
        raise ValidationError(
            f"{architecture} is not a causal language model (model_type "
            f"{config.get('model_type')!r}); Treadle trains decoder-only causal LMs "
            "(a ...ForCausalLM class)"
        )
    return architecture


def _check_not_quantised(config: dict[str, Any]) -> None:
    quant = config.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    how = (
        "load it with transformers' Mxfp4Config(dequantize=True), save_pretrained the bfloat16 "
        "model and register that folder"
        if method == "mxfp4"
        else "dequantise it to bfloat16 or float32, save_pretrained, and register that folder"
    )
    raise ValidationError(
        f"config.json says the checkpoint is quantised ({method}); Treadle trains LoRA on "
        f"unquantised base weights: {how}"
    )


def _positive_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValidationError(f"config.json's {key} is {value!r}; it must be a positive integer")
    return value


def _weights(folder: Path) -> tuple[int, int, dict[str, list[int]]]:
    """(parameters, bytes, tensor name -> shape) of the safetensors weights in `folder`, from
    their headers."""
    index = _json_file(folder / "model.safetensors.index.json", "model.safetensors.index.json")
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValidationError("model.safetensors.index.json has no weight_map; fix the file")
        files = sorted({str(f) for f in weight_map.values()})
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValidationError(
            f"{folder} has no safetensors weights (model.safetensors or "
            "model.safetensors.index.json); save the model with save_pretrained"
        )
    parameters = size = 0
    shapes: dict[str, list[int]] = {}
    for file in files:
        p, b = _safetensors_header(folder / file, shapes)
        parameters, size = parameters + p, size + b
    return parameters, size, shapes


def _safetensors_header(path: Path, shapes: dict[str, list[int]]) -> tuple[int, int]:
    """(parameters, bytes) of the safetensors file at `path`; adds its tensors' shapes."""
    if not path.is_file():
        raise ValidationError(
            f"{path.name}, listed in the weight index, is missing from {path.parent}"
        )
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(f.read(length))
        parameters = size = 0
        for key, tensor in header.items():
            if key == "__metadata__":
                continue
            parameters += math.prod(tensor["shape"])
            shapes[key] = [int(n) for n in tensor["shape"]]
            start, end = tensor["data_offsets"]
            size += end - start
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise ValidationError(f"{path.name} is not a readable safetensors file ({exc})") from None
    return parameters, size


def _tokenizer_vocab_size(folder: Path) -> int:
    """How many token ids the folder's tokenizer uses (its largest id + 1)."""
    data = _json_file(folder / "tokenizer.json", "tokenizer.json")
    if data is not None:
        model = data.get("model")
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
            ids = [int(i) for i in vocab.values()]
        elif isinstance(vocab, list):  # Unigram: [piece, score] by id
            ids = [len(vocab) - 1] if vocab else []
        else:
            raise ValidationError("tokenizer.json has no model.vocab; fix or regenerate the file")
        ids += [int(t["id"]) for t in data.get("added_tokens") or [] if "id" in t]
        if not ids:
            raise ValidationError("tokenizer.json holds no tokens; fix or regenerate the file")
        return max(ids) + 1
    if (folder / "tokenizer.model").is_file():
        return _sentencepiece_size(folder)
    raise ValidationError(
        f"{folder} has no tokenizer: it needs tokenizer.json (a fast tokenizer) or "
        "tokenizer.model (SentencePiece); save the tokenizer with save_pretrained into the folder"
    )


def _sentencepiece_size(folder: Path) -> int:
    import sentencepiece  # lazily: only SentencePiece-only folders need it

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(str(folder / "tokenizer.model"))
    except (OSError, RuntimeError) as exc:
        raise ValidationError(f"tokenizer.model is not a SentencePiece model ({exc})") from None
    size = int(processor.GetPieceSize())
    added = _json_file(folder / "added_tokens.json", "added_tokens.json") or {}
    return max([size - 1, *(int(i) for i in added.values())]) + 1


def _targets(requested: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [t for t in requested if t not in LORA_CATEGORIES]
    if unknown or not requested:
        raise ValidationError(
            f"lora_targets {list(requested)} must be a non-empty subset of {list(LORA_CATEGORIES)}"
        )
    return tuple(t for t in LORA_CATEGORIES if t in requested)


def _human(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
