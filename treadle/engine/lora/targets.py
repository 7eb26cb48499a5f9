"""Which linears of a loaded causal LM a LoRA adapter trains, by category: attention, MLP and
unembedding (`LoraSpec`'s `train_attn`, `train_mlp`, `train_unembed`).

Applies the target rules of `treadle/platform/models/lora_names.py` (the suffix tables, router
and block names, which registration applies to a folder's tensor names too; re-exported here)
to the loaded modules: owns `resolve(model) -> LoraTargets` and the
refusals: a requested category that matches no linear, one whose blocks hold linears the tables do
not know, and MLP training where the experts are 3-D parameters (no `nn.Linear` to wrap). A linear
counts by where it sits (inside a decoder layer's attention block or its MLP block) and by its
name; MoE routers are never targets.
Must not import flask, sqlalchemy, celery, treadle.api or treadle.engine.lora.adapters (which uses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn

from treadle.platform.errors import ValidationError
from treadle.platform.models.lora_names import (
    ATTN_SUFFIXES,
    MLP_SUFFIXES,
    UNEMBED_SUFFIXES,
    Category,
    suffix_category,
)
from treadle.platform.models.lora_names import BLOCK_CLASS_HINTS as _BLOCK_CLASS_HINTS
from treadle.platform.models.lora_names import BLOCK_NAMES as _BLOCK_NAMES
from treadle.platform.models.lora_names import ROUTER_NAMES as _ROUTER_NAMES
from treadle.platform.models.lora_names import suffixes as _suffixes

__all__ = [
    "ATTN_SUFFIXES",
    "MLP_SUFFIXES",
    "UNEMBED_SUFFIXES",
    "Category",
    "LoraTargets",
    "TrainFlags",
    "resolve",
    "suffix_category",
]

_FLAGS: dict[Category, tuple[str, str]] = {  # category -> (spec flag, words for messages)
    "attn": ("train_attn", "attention"),
    "mlp": ("train_mlp", "MLP"),
    "unembed": ("train_unembed", "unembedding"),
}


class TrainFlags(Protocol):
    """What `for_spec` reads of a `LoraSpec`."""

    @property
    def train_attn(self) -> bool: ...
    @property
    def train_mlp(self) -> bool: ...
    @property
    def train_unembed(self) -> bool: ...


@dataclass(frozen=True)
class LoraTargets:
    """The linears of one model each category trains (module names, in the model's order).

    `linears` is every target of any category, in module order. `unknown` pairs a category with
    a linear inside one of its blocks whose name the tables do not know: training that category
    is refused rather than leaving the linear untrained. (A linear of a decoder layer outside
    both kinds of block, with a name of neither, belongs to no category and stays frozen.) `experts_3d`: the MLP experts are 3-D
    parameters, so MLP training is refused.
    """

    architecture: str
    attn: tuple[str, ...]
    mlp: tuple[str, ...]
    unembed: tuple[str, ...]
    linears: tuple[str, ...]
    experts_3d: bool = False
    unknown: tuple[tuple[Category, str], ...] = ()

    def for_spec(self, spec: TrainFlags) -> tuple[str, ...]:
        """The modules an adapter with `spec`'s flags trains, in module order.

        Raises ValidationError when no flag is set, when MLP training is asked of a model whose
        experts are 3-D parameters, or when a requested category matches no linear or holds
        linears Treadle does not recognise; the message names the flag to turn off.
        """
        wanted: list[Category] = [c for c in _FLAGS if getattr(spec, _FLAGS[c][0])]
        if not wanted:
            raise ValidationError(
                "train_attn, train_mlp and train_unembed are all false; enable at least one"
            )
        if "mlp" in wanted and self.experts_3d:
            raise ValidationError(
                f"{self.architecture} keeps its MLP experts as 3-D parameters, which Treadle "
                "cannot adapt with LoRA yet; create the session with train_mlp=False (attention "
                "and unembedding are adapted)"
            )
        chosen: set[str] = set()
        for category in wanted:
            flag, words = _FLAGS[category]
            strangers = [name for c, name in self.unknown if c == category]
            if strangers:
                raise ValidationError(
                    f"{self.architecture}'s {words} blocks hold linears Treadle does not "
                    f"recognise ({', '.join(strangers[:3])}{', ...' if len(strangers) > 3 else ''})"
                    f"; create the session with {flag}=False, or add their names to the suffix "
                    "table in treadle/platform/models/lora_names.py"
                )
            found = getattr(self, category)
            if not found:
                raise ValidationError(
                    f"{self.architecture} has no {words} linear Treadle can adapt with LoRA; "
                    f"create the session with {flag}=False"
                )
            chosen.update(found)
        return tuple(name for name in self.linears if name in chosen)

    def suffixes(self, spec: TrainFlags) -> tuple[str, ...]:
        """The last name components of `for_spec(spec)`, sorted: peft's `target_modules`."""
        return tuple(sorted({name.rsplit(".", 1)[-1] for name in self.for_spec(spec)}))


def resolve(model: nn.Module) -> LoraTargets:
    """The LoRA targets of `model`, a transformers causal LM as loaded (before any wrapping)."""
    architecture = type(model).__name__
    model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
    suffixes = {c: _suffixes(c, model_type) for c in _FLAGS}
    layers = _decoder_layers(model)
    head = _output_linear(model)
    found: dict[Category, list[str]] = {"attn": [], "mlp": [], "unembed": []}
    linears: list[str] = []
    unknown: list[tuple[Category, str]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        suffix = name.rsplit(".", 1)[-1]
        category: Category | None = None
        path = _path_in_layer(name, layers)
        if module is head or (head is None and path is None and suffix in suffixes["unembed"]):
            category = "unembed"
        elif path is not None:
            block = _block(model, name, path)
            if block == "mlp" and _ROUTER_NAMES & set(path[1:]):
                continue
            if block is None:  # directly in the layer or in an unnamed block: by name alone
                category = next((c for c in ("attn", "mlp") if suffix in suffixes[c]), None)
            elif suffix in suffixes[block]:
                category = block
            else:
                unknown.append((block, name))
        if category is not None:
            found[category].append(name)
            linears.append(name)
    return LoraTargets(
        architecture=architecture,
        attn=tuple(found["attn"]),
        mlp=tuple(found["mlp"]),
        unembed=tuple(found["unembed"]),
        linears=tuple(linears),
        experts_3d=_has_3d_experts(model, layers),
        unknown=tuple(unknown),
    )


# -- internals -----------------------------------------------------------------------------------


def _decoder_layers(model: nn.Module) -> str | None:
    """The name of the decoder stack: the `nn.ModuleList` holding the most parameters."""
    best, best_size = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = name, size
    return best


def _path_in_layer(name: str, layers: str | None) -> list[str] | None:
    """`name`'s components below its decoder layer (`[..., leaf]`), None if in no layer."""
    if layers is None or not name.startswith(layers + "."):
        return None
    parts = name[len(layers) + 1 :].split(".")
    return parts[1:] if len(parts) > 1 and parts[0].isdigit() else None


def _block(model: nn.Module, name: str, path: list[str]) -> Category | None:
    """Whether the linear `name` sits in an attention or an MLP block of its layer: the first
    module on its path (below the layer) whose name or class marks one."""
    prefix = name[: len(name) - len(".".join(path))].rstrip(".")
    for i, part in enumerate(path[:-1]):
        module = model.get_submodule(".".join([prefix, *path[: i + 1]]))
        cls = type(module).__name__
        for category in ("attn", "mlp"):
            hinted = any(h in cls for h in _BLOCK_CLASS_HINTS[category])
            if part in _BLOCK_NAMES[category] or hinted:
                return category
    return None


def _output_linear(model: nn.Module) -> nn.Linear | None:
    """The unembedding: transformers' output embeddings where they are a linear."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Linear) else None


def _has_3d_experts(model: nn.Module, layers: str | None) -> bool:
    """Whether a decoder layer's MLP block holds parameters of 3 or more dimensions (experts
    stacked as [experts, in, out], as transformers 5 stores Qwen3-MoE's and gpt-oss's)."""
    for name, parameter in model.named_parameters():
        path = _path_in_layer(name, layers)
        if parameter.dim() >= 3 and path is not None and _block(model, name, path) == "mlp":
            return True
    return False
