"""A base model built with its parameters on the meta device, read from its safetensors files
one module at a time (`WeightFiles.materialize`): what a sharded worker group loads, so that no
rank ever holds the whole model in host memory (`distributed.group.shard_layers` reads a decoder
layer, shards it and frees it before reading the next).

Owns `build_deferred` (the model from its config, parameters on meta, buffers real, as
`from_pretrained` would leave them) and `WeightFiles` (which file holds each parameter; a read
opens the file and takes a module's tensors: over the file's mapping where the dtype is the
file's, as `from_pretrained` leaves them, converted copies where it is not; or a range of one
parameter's rows, a rank's share of the vocabulary). A folder
whose tensor names are not the model's own (a checkpoint transformers converts while loading,
such as per-expert MoE weights it stacks) has no `WeightFiles`: the caller loads it whole.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

__all__ = ["WeightFiles", "build_deferred"]


class WeightFiles:
    """Where each meta parameter of a model built by `build_deferred` is stored.

    `keys` maps a meta parameter (by identity: the module names change once LoRA wraps the
    linears) to its tensor name in the files; `files` maps a tensor name to its file.
    """

    def __init__(self, keys: dict[int, str], files: dict[str, Path], dtype: torch.dtype) -> None:
        self.keys = keys
        self.files = files
        self.dtype = dtype

    def materialize(self, module: nn.Module) -> int:
        """Replace every meta parameter under `module` with its values from the files, in host
        memory in this model's dtype (a parameter two modules share stays one). Returns the
        bytes read."""
        found: dict[int, list[tuple[nn.Module, str]]] = {}
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is not None and param.is_meta:
                    found.setdefault(id(param), []).append((owner, name))
        by_file: dict[Path, list[int]] = {}
        for ident in found:
            by_file.setdefault(self.files[self.keys[ident]], []).append(ident)
        read = 0
        for path, idents in by_file.items():
            with safe_open(str(path), framework="pt") as f:  # closed (unmapped) after the module
                for ident in idents:
                    owner, name = found[ident][0]
                    meta = owner._parameters[name]
                    assert meta is not None
                    # in the file's dtype, over its mapping (the page cache, shared by the
                    # ranks), as `from_pretrained` leaves it; a copy where the dtype changes
                    values = f.get_tensor(self.keys[ident]).to(self.dtype)
                    if tuple(values.shape) != tuple(meta.shape):
                        raise ValueError(
                            f"{self.keys[ident]} in {path.name} has shape {list(values.shape)}; "
                            f"the model built from config.json needs {list(meta.shape)}"
                        )
                    param = nn.Parameter(values, requires_grad=meta.requires_grad)
                    for holder, attr in found[ident]:
                        holder._parameters[attr] = param
                    read += values.numel() * values.element_size()
        return read

    def rows(self, param: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the meta parameter `param` (its first dimension), read from its
        file alone, in host memory in this model's dtype: a rank's share of an embedding."""
        name = self.keys[id(param)]
        with safe_open(str(self.files[name]), framework="pt") as f:
            part = f.get_slice(name)
            shape = part.get_shape()
            if list(shape) != list(param.shape):
                raise ValueError(
                    f"{name} in {self.files[name].name} has shape {list(shape)}; the model "
                    f"built from config.json needs {list(param.shape)}"
                )
            return part[lo:hi].to(self.dtype).contiguous()


def build_deferred(
    folder: Path,
    dtype: torch.dtype,
    attention: str | None = None,
    config: PretrainedConfig | None = None,
) -> tuple[PreTrainedModel, WeightFiles | None]:
    """The causal LM saved in `folder`, frozen and in eval mode, with `attention` as its
    attention implementation (None: transformers' default), its parameters on the meta device (its buffers real, in `dtype`),
    and where its weights are; or the model loaded whole (`from_pretrained`) and None where the
    files' tensor names are not the model's."""
    files = _tensor_files(folder) or {}
    if config is None:  # else the caller read it already
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    model.tie_weights()  # as `from_pretrained` does once it has loaded
    model.to(dtype=dtype)  # type: ignore[call-arg]  # the buffers, as a whole load's `to` does
    named = list(model.named_parameters(remove_duplicate=False))
    keys = {id(param): name for name, param in named if name in files}
    if any(id(param) not in keys for _, param in named):
        whole = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, local_files_only=True, attn_implementation=attention
        )
        whole.to(device="cpu", dtype=dtype)  # type: ignore[call-arg]
        return _frozen(whole), None
    return _frozen(model), WeightFiles(keys, files, dtype)


def _frozen(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    model.requires_grad_(False)
    return model


def _tensor_files(folder: Path) -> dict[str, Path] | None:
    """Each tensor name in the folder's safetensors files (one file, or an index's shards) with
    its file; None where the folder has no safetensors weights."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    with safe_open(str(single), framework="pt") as f:
        names = f.keys()  # a safe_open is not iterable
    return dict.fromkeys(names, single)
