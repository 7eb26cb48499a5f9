"""Tokenizer files of base models, and what a GGUF file's metadata says.

A registered Hugging Face folder (kind "hf") is served and loaded from its own files
(`TOKENIZER_FILES`: tokenizer.json or a SentencePiece tokenizer.model, tokenizer_config.json
with its chat template, generation_config.json, config.json, and a vision-language model's
image processor, preprocessor_config.json). A GGUF model's tokenizer (the
built-ins' from the SmolLM2 GGUF, a registered GGUF's from its own file) is built once into the
on-disk cache (`<cache_dir>/tokenizers/<safe name>.v<N>/`): the GGUF's byte-level BPE vocabulary
converted into a Hugging Face fast tokenizer (tokenizer.json, tokenizer_config.json,
chat_template.jinja), written as plain JSON from the file's own metadata (`gguf_metadata`) so
the files do not depend on the installed transformers version (their GGUF converters disagree
with each other). Clients load them with `AutoTokenizer.from_pretrained(folder)` or through the
hub-compatible routes (`api/tinker/routes_hf`).
Must not import torch or transformers at import time (the API process serves these files
without them); `gguf` and transformers are imported lazily, when building and loading.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.platform.models.catalog import BaseModelInfo, get_base_model, gguf_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "FORMAT_VERSION",
    "TOKENIZER_FILES",
    "gguf_metadata",
    "load_tokenizer",
    "safe_name",
    "tokenizer_dir",
    "tokenizer_file_names",
    "tokenizer_files",
    "tokenizer_from_gguf",
]

# Part of the cache folder's name: bump it whenever the built files change, so a cache written by
# an older Treadle is rebuilt rather than served. v2: files built from the GGUF metadata directly,
# digits split one by one as the GGUF's "smollm" pre-tokenizer requires.
FORMAT_VERSION = 2

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types (gguf.TokenType) that become added tokens
_BYTE_LEVEL = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
# llama.cpp's pre-tokenizers per `tokenizer.ggml.pre`: "smollm" (like StarCoder) splits every
# digit on its own before the GPT-2 regex; "gpt2" is the GPT-2 regex alone.
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "gpt2": {"type": "ByteLevel", **_BYTE_LEVEL},
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", **_BYTE_LEVEL},
        ],
    },
}


# What a tokenizer is made of on the hub: the files `/hf` serves for a registered model.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
    "preprocessor_config.json",  # a vision-language model's image processor
)


def tokenizer_file_names(folder: Path) -> list[str]:
    """The tokenizer files present in `folder`, in `TOKENIZER_FILES` order."""
    return [name for name in TOKENIZER_FILES if (Path(folder) / name).is_file()]


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The `general.*`, `tokenizer.*` and `<architecture>.*` fields of the GGUF file at `path`
    (arrays as lists), and its parameter count under "parameters"."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    fields = {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith(("general.", "tokenizer.", f"{arch}."))
    }
    fields["parameters"] = sum(int(t.n_elements) for t in reader.tensors)
    return fields


def safe_name(model_name: str) -> str:
    """A folder name for `model_name` ("HuggingFaceTB/SmolLM2" -> "HuggingFaceTB--SmolLM2")."""
    return model_name.replace("/", "--")


def tokenizer_dir(base_model: str | BaseModelInfo, cache_dir: Path) -> Path:
    """The tokenizer folder of `base_model`: a registered model's own folder, or the built-ins'
    cached one, built first if needed. A name is looked up among the built-ins."""
    info = base_model if isinstance(base_model, BaseModelInfo) else get_base_model(base_model)
    if info.kind == "hf":
        assert info.path is not None, info
        return Path(info.path)
    source = info.tokenizer_source
    folder = Path(cache_dir) / "tokenizers" / f"{safe_name(source)}.v{FORMAT_VERSION}"
    if not (folder / "tokenizer.json").is_file():
        _build(folder, info)
    return folder


def tokenizer_files(base_model: str | BaseModelInfo, cache_dir: Path) -> dict[str, bytes]:
    """Every file of `base_model`'s tokenizer, by file name.

    Raises ValidationError for an unknown built-in name.
    """
    folder = tokenizer_dir(base_model, cache_dir)
    if isinstance(base_model, BaseModelInfo) and base_model.kind == "hf":
        names = tokenizer_file_names(folder)
        return {name: (folder / name).read_bytes() for name in names}
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def load_tokenizer(base_model: str | BaseModelInfo, cache_dir: Path) -> PreTrainedTokenizerBase:
    """`base_model`'s tokenizer: a registered model's through AutoTokenizer from its folder,
    a built-in's from the cache folder (built on first use)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = tokenizer_dir(base_model, cache_dir)
    if isinstance(base_model, BaseModelInfo) and base_model.kind == "hf":
        loaded: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True
        )
        return loaded
    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tokenizer


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> dict[str, bytes]:
    """The fast-tokenizer files described by a GGUF's `tokenizer.*` metadata, by file name.

    `metadata` maps GGUF keys to their values (lists for arrays). Only byte-level BPE
    vocabularies (`tokenizer.ggml.model == "gpt2"`) with a pre-tokenizer llama.cpp names
    "gpt2" or "smollm" are understood; anything else is a ValueError saying which.
    """
    model = metadata["tokenizer.ggml.model"]
    pre = metadata.get("tokenizer.ggml.pre", "gpt2")
    if model != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"cannot convert a GGUF tokenizer of type {model!r} with pre-tokenizer {pre!r}; "
            f"only 'gpt2' vocabularies with pre-tokenizer {sorted(_PRE_TOKENIZERS)} are supported"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types: list[int] = list(metadata["tokenizer.ggml.token_type"])
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind == _CONTROL,
        }
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS[pre],
        "post_processor": {  # no BOS/EOS added: the GGUF says add_bos_token false
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {},
        },
        "decoder": {"type": "ByteLevel", **_BYTE_LEVEL},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": [merge.split(" ", 1) for merge in metadata["tokenizer.ggml.merges"]],
        },
    }

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # a class transformers 4.x also knows
        "backend": "tokenizers",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # decode(encode(text)) == text
        "model_max_length": int(
            metadata.get(f"{metadata.get('general.architecture', 'llama')}.context_length", 2048)
        ),
    }
    files = {"tokenizer.json": _json_bytes(tokenizer_json, indent=None)}
    template = metadata.get("tokenizer.chat_template")
    if template:  # transformers < 4.43 reads the template only from the config; newer, the file
        config["chat_template"] = template
        files["chat_template.jinja"] = str(template).encode()
    files["tokenizer_config.json"] = _json_bytes(
        {k: v for k, v in config.items() if v is not None}, indent=2
    )
    return files


def _json_bytes(value: Any, indent: int | None) -> bytes:
    return (json.dumps(value, indent=indent, ensure_ascii=False) + "\n").encode()


def _build(folder: Path, info: BaseModelInfo) -> None:
    """Convert `info`'s GGUF tokenizer into `folder`, atomically: racing processes each build
    in a private temporary folder and the first rename wins."""
    files = tokenizer_from_gguf(gguf_metadata(gguf_path(info)))
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name, content in files.items():
            (tmp / name).write_bytes(content)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
        _publish(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, folder: Path) -> None:
    """Rename `tmp` to `folder` unless another process already published it."""
    try:
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "tokenizer.json").is_file():
            raise
