"""Which linears of a loaded causal LM a LoRA adapter trains, by category: attention, MLP and
unembedding (`LoraSpec`'s `train_attn`, `train_mlp`, `train_unembed`).

Applies the target rules of `treadle/platform/models/lora_names.py` (the suffix tables, router
and block names, which registration applies to a folder's tensor names too; re-exported here)
to the loaded modules: owns `resolve(model) -> LoraTargets` and the refusals: a requested
category that matches no target, or one whose blocks hold linears or 3-D parameters the tables
do not know. A linear counts by where it sits (inside a decoder layer's attention block or its
MLP block) and by its name. MoE experts stored as 3-D parameters (transformers 5's Qwen3-MoE and
gpt-oss) are MLP targets too, one per parameter, named `<experts module>:<parameter>`
(`expert_key`), as peft's `target_parameters` adapts them; MoE routers are never targets.
Must not import flask, sqlalchemy, celery, treadle.api or treadle.engine.lora.adapters (which uses it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
    "EXPERT_PROJECTIONS",
    "MLP_SUFFIXES",
    "UNEMBED_SUFFIXES",
    "Category",
    "LoraTargets",
    "TrainFlags",
    "expert_key",
    "is_expert_key",
    "parameter_suffixes",
    "peft_module_paths",
    "resolve",
    "split_expert_key",
    "suffix_category",
]

# The 3-D parameters of an experts module (transformers' `use_experts_implementation` layout:
# [experts, out, in], or [experts, in, out] where the module says `is_transposed`) that LoRA
# adapts, by role: the first projection (with or without the gate) and the second.
EXPERT_PROJECTIONS = {"gate_up_proj": "up", "up_proj": "up", "down_proj": "down"}

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
    """The targets of one model each category trains (in the model's order): linears by module
    name, experts' 3-D parameters by `expert_key` (MLP targets).

    `linears` is every linear target of any category, `experts` every expert parameter, `order`
    both together, in the model's order. `unknown` pairs a category with a linear (or a 3-D
    parameter) inside one of its blocks that the tables do not know: training that category is
    refused rather than leaving it untrained. (A linear of a decoder layer outside both kinds of
    block, with a name of neither, belongs to no category and stays frozen.) `experts_3d`: the
    MLP experts are 3-D parameters.
    """

    architecture: str
    attn: tuple[str, ...]
    mlp: tuple[str, ...]
    unembed: tuple[str, ...]
    linears: tuple[str, ...]
    experts: tuple[str, ...] = ()
    order: tuple[str, ...] = ()
    experts_3d: bool = False
    unknown: tuple[tuple[Category, str], ...] = ()

    def for_spec(self, spec: TrainFlags) -> tuple[str, ...]:
        """The targets an adapter with `spec`'s flags trains, in the model's order.

        Raises ValidationError when no flag is set, or when a requested category matches no
        target or holds linears (or expert parameters) Treadle does not recognise; the message
        names the flag to turn off.
        """
        wanted: list[Category] = [c for c in _FLAGS if getattr(spec, _FLAGS[c][0])]
        if not wanted:
            raise ValidationError(
                "train_attn, train_mlp and train_unembed are all false; enable at least one"
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
        return tuple(name for name in self.order if name in chosen)

    def suffixes(self, spec: TrainFlags) -> tuple[str, ...]:
        """The last name components of the linears of `for_spec(spec)`, sorted: peft's
        `target_modules`."""
        chosen = self.for_spec(spec)
        return tuple(sorted({n.rsplit(".", 1)[-1] for n in chosen if not is_expert_key(n)}))

    def parameter_suffixes(self, spec: TrainFlags) -> tuple[str, ...]:
        """`<experts module's last name>.<parameter>` of the expert parameters of
        `for_spec(spec)`, sorted: peft's `target_parameters` (e.g. `experts.down_proj`)."""
        return parameter_suffixes(self.for_spec(spec))


def expert_key(module: str, parameter: str) -> str:
    """The target name of an experts module's 3-D parameter (`model.layers.0.mlp.experts` and
    `gate_up_proj` give `model.layers.0.mlp.experts:gate_up_proj`)."""
    return f"{module}:{parameter}"


def is_expert_key(name: str) -> bool:
    return ":" in name


def split_expert_key(name: str) -> tuple[str, str]:
    """(experts module name, parameter name) of an `expert_key`."""
    module, _, parameter = name.partition(":")
    return module, parameter


def peft_module_paths(names: Sequence[str]) -> list[str]:
    """The module path peft gives each target of `names` (in the model's order): a linear's
    own name; for an expert parameter, the `ParamWrapper` peft puts around its experts module,
    one per targeted parameter, nested in the module's parameter order, the last outermost
    (`experts` for `down_proj`, `experts.base_layer` for `gate_up_proj` before it)."""
    later: dict[str, int] = {}
    paths: list[str] = []
    for name in reversed(names):
        if is_expert_key(name):
            module, _ = split_expert_key(name)
            paths.append(module + ".base_layer" * later.get(module, 0))
            later[module] = later.get(module, 0) + 1
        else:
            paths.append(name)
    return paths[::-1]


def parameter_suffixes(names: Iterable[str]) -> tuple[str, ...]:
    """peft's `target_parameters` for the expert keys among `names`, sorted."""
    out = set()
    for name in names:
        if is_expert_key(name):
            module, parameter = split_expert_key(name)
            out.add(f"{module.rsplit('.', 1)[-1]}.{parameter}")
    return tuple(sorted(out))


def resolve(model: nn.Module) -> LoraTargets:
    """The LoRA targets of `model`, a transformers causal LM as loaded (before any wrapping)."""
    architecture = type(model).__name__
    model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
    suffixes = {c: _suffixes(c, model_type) for c in _FLAGS}
    layers = _decoder_layers(model)
    head = _output_linear(model)
    found: dict[Category, list[str]] = {"attn": [], "mlp": [], "unembed": []}
    linears: list[str] = []
    experts: list[str] = []
    order: list[str] = []
    unknown: list[tuple[Category, str]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            keys, strangers = _expert_parameters(model, name, module, layers)
            found["mlp"].extend(keys)
            experts.extend(keys)
            order.extend(keys)
            unknown.extend(("mlp", s) for s in strangers)
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
            order.append(name)
    return LoraTargets(
        architecture=architecture,
        attn=tuple(found["attn"]),
        mlp=tuple(found["mlp"]),
        unembed=tuple(found["unembed"]),
        linears=tuple(linears),
        experts=tuple(experts),
        order=tuple(order),
        experts_3d=bool(experts) or any(c == "mlp" and ":" in n for c, n in unknown),
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


def _expert_parameters(
    model: nn.Module, name: str, module: nn.Module, layers: str | None
) -> tuple[list[str], list[str]]:
    """The expert keys of `module`'s own 3-D parameters, where it is an experts module of a
    decoder layer's MLP block (in its parameters' order), and the keys of those Treadle cannot
    adapt: a parameter of another name or rank, or a module without transformers' experts
    layout (`is_transposed`, `has_gate`, `has_bias`), whose forward Treadle cannot follow."""
    stacked = [(p, t) for p, t in module.named_parameters(recurse=False) if t.dim() >= 3]
    path = _path_in_layer(name, layers) if stacked else None
    if path is None or _block(model, f"{name}.{stacked[0][0]}", [*path, stacked[0][0]]) != "mlp":
        return [], []
    keys: list[str] = []
    strangers: list[str] = []
    laid_out = all(hasattr(module, a) for a in ("is_transposed", "has_gate", "has_bias"))
    for parameter, tensor in stacked:
        fine = laid_out and tensor.dim() == 3 and parameter in EXPERT_PROJECTIONS
        (keys if fine else strangers).append(expert_key(name, parameter))
    return keys, strangers
