"""Adapter and merged-model folders on disk: what `Engine.export_*` writes and `import_adapter` /
`load_snapshot` read.

An adapter folder is what peft's `save_pretrained` writes for a causal LM's LoRA
(`adapter_model.safetensors`, `adapter_config.json` whose `target_modules` are the last name
components of the adapted linears, e.g. Phi-3's `qkv_proj` and `gate_up_proj`, and whose
`target_parameters` name the MoE experts' adapted 3-D parameters, e.g. `experts.gate_up_proj`),
plus `treadle.json` (the full `LoraSpec`, its optimizer too,
base model and format version) and, optionally, `optimizer.safetensors` (the exact optimizer
state: AdamW's `<tensor name>.<step|exp_avg|exp_avg_sq>`, Dimuon's `<tensor name>.momentum_buffer`). A merged folder is a plain Hugging Face model
(config, float32 `model.safetensors`, generation config, tokenizer files) with every LoRA delta
folded into its base weight, loadable with `transformers` alone.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import nn
from transformers import PreTrainedModel

from treadle.engine.lora.adapters import LoraSpec, LoraWeights
from treadle.engine.lora.experts import expert_factors
from treadle.engine.lora.targets import (
    Category,
    is_expert_key,
    parameter_suffixes,
    split_expert_key,
    suffix_category,
)
from treadle.engine.optim import OPTIMIZERS
from treadle.platform.errors import ValidationError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "FORMAT_VERSION",
    "OPTIMIZER_STATE",
    "TREADLE_CONFIG",
    "SavedAdapter",
    "read_adapter",
    "write_adapter",
    "write_merged",
]

FORMAT_VERSION = 1
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
TREADLE_CONFIG = "treadle.json"
OPTIMIZER_STATE = "optimizer.safetensors"

OptimizerState = dict[str, dict[str, torch.Tensor]]


@dataclass
class SavedAdapter:
    spec: LoraSpec
    tensors: dict[str, np.ndarray]  # peft names -> float32
    optimizer: OptimizerState | None  # None unless asked for


def write_adapter(
    folder: Path,
    base_model: str,
    spec: LoraSpec,
    weights: LoraWeights,
    optimizer: OptimizerState | None,
) -> None:
    """Write `weights` into `folder` (created if needed) as a peft adapter for `base_model`, with
    `optimizer` (as `TrainableLora.optimizer_state` gives it) when not None."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: _cpu(t) for name, t in weights.tensors()}
    safetensors.torch.save_file(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    targets = sorted({n.rsplit(".", 1)[-1] for n in weights.A if not is_expert_key(n)})
    peft_config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    if parameters := parameter_suffixes(weights.A):
        peft_config["target_parameters"] = list(parameters)
    _write_json(folder / ADAPTER_CONFIG, peft_config)
    _write_json(
        folder / TREADLE_CONFIG,
        {
            "format": "treadle-lora",
            "format_version": FORMAT_VERSION,
            "base_model": base_model,
            # an AdamW adapter's file reads as it did before Dimuon (no `optimizer` entry)
            "lora": {
                k: v
                for k, v in dataclasses.asdict(spec).items()
                if not (k == "optimizer" and v == "adamw")
            },
            "has_optimizer": optimizer is not None,
        },
    )
    (folder / OPTIMIZER_STATE).unlink(missing_ok=True)
    if optimizer is not None:
        flat = {f"{name}.{key}": _cpu(v) for name, e in optimizer.items() for key, v in e.items()}
        safetensors.torch.save_file(flat, folder / OPTIMIZER_STATE, metadata={"format": "pt"})


def read_adapter(folder: Path, base_model: str, *, with_optimizer: bool) -> SavedAdapter:
    """The adapter in `folder` (as `write_adapter` or peft wrote it), checked to be for
    `base_model`; its optimizer state only `with_optimizer`. ValidationError for a missing or
    unreadable file, another base model or a configuration Treadle cannot run."""
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValidationError(f"checkpoint has no {ADAPTER_WEIGHTS}; is it an adapter checkpoint?")
    if (folder / TREADLE_CONFIG).is_file():
        spec, saved_base = _treadle_spec(_read_json(folder / TREADLE_CONFIG))
    elif (folder / ADAPTER_CONFIG).is_file():
        spec, saved_base = _peft_spec(_read_json(folder / ADAPTER_CONFIG))
    else:
        raise ValidationError(f"checkpoint has neither {TREADLE_CONFIG} nor {ADAPTER_CONFIG}")
    if saved_base is not None and saved_base != base_model:
        raise ValidationError(
            f"checkpoint was trained on base model {saved_base!r}, not {base_model!r}; load it "
            f"into a session of {saved_base!r}"
        )
    # peft saves the frozen weight of a targeted embedding layer (lm_head) beside its LoRA, as
    # `<module>.base_layer.weight`; it is the base model's, which Treadle has already.
    tensors = {
        name: t.float().numpy()
        for name, t in _load_safetensors(folder / ADAPTER_WEIGHTS)
        if not name.endswith(".base_layer.weight")
    }
    optimizer: OptimizerState | None = None
    if with_optimizer:
        if not (folder / OPTIMIZER_STATE).is_file():
            raise ValidationError(
                f"checkpoint has no optimizer state ({OPTIMIZER_STATE}); load it without the "
                "optimizer, or save one with it"
            )
        optimizer = {}
        for key, value in _load_safetensors(folder / OPTIMIZER_STATE):
            name, _, entry = key.rpartition(".")
            optimizer.setdefault(name, {})[entry] = value
    return SavedAdapter(spec, tensors, optimizer)


def write_merged(
    folder: Path, model: PreTrainedModel, weights: LoraWeights, tokenizer_files: Mapping[str, bytes]
) -> None:
    """Fold `weights` into `model` (a bare float32 CPU base model, changed in place: W += scale *
    B @ A, for each expert of an experts module's 3-D parameter) and save it with `tokenizer_files` into `folder` as a Hugging Face model. If the
    unembedding gets a delta but is tied to the embedding, it is untied first, so the embedding
    keeps its base weights."""
    folder.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        assert isinstance(head, nn.Linear) and isinstance(embed, nn.Embedding)
        head_name = next(name for name, module in model.named_modules() if module is head)
        head_delta = head_name in weights.A
        tied = head.weight is embed.weight or getattr(model.config, "tie_word_embeddings", False)
        if head_delta and tied:
            head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
            model.config.tie_word_embeddings = False
        for module, a_r_in in weights.A.items():
            if is_expert_key(module):
                _merge_experts(model, module, weights)
                continue
            linear = model.get_submodule(module)
            assert isinstance(linear, nn.Linear)
            delta = (weights.B[module].double().cpu() @ a_r_in.double().cpu()) * weights.scale
            linear.weight.copy_((linear.weight.double() + delta).float())
    model.save_pretrained(str(folder))
    for name, data in tokenizer_files.items():
        (folder / name).write_bytes(data)


# -- internals -----------------------------------------------------------------------------------


def _merge_experts(model: nn.Module, key: str, weights: LoraWeights) -> None:
    """W[e] += scale * B_e @ A_e for every expert e of the 3-D parameter `key` names."""
    name, parameter = split_expert_key(key)
    experts = model.get_submodule(name)
    stack = getattr(experts, parameter)
    a_E_r_in, b_E_out_r = expert_factors(
        weights.A[key].double().cpu(), weights.B[key].double().cpu(), stack.shape[0]
    )
    delta_E_out_in = torch.bmm(b_E_out_r, a_E_r_in) * weights.scale
    if experts.is_transposed:  # stored [experts, in, out]
        delta_E_out_in = delta_E_out_in.transpose(1, 2)
    stack.copy_((stack.double() + delta_E_out_in).float())


def _treadle_spec(config: Mapping[str, Any]) -> tuple[LoraSpec, str | None]:
    version = config.get("format_version")
    if config.get("format") != "treadle-lora" or version != FORMAT_VERSION:
        raise ValidationError(
            f"{TREADLE_CONFIG} is format {config.get('format')!r} version {version!r}; this "
            f"worker reads treadle-lora version {FORMAT_VERSION}"
        )
    lora = config.get("lora")
    fields = {f.name for f in dataclasses.fields(LoraSpec)}
    if (
        not isinstance(lora, dict)
        or not {"rank", "alpha"} <= set(lora) <= fields
        or not isinstance(lora["rank"], int)
        or not isinstance(lora["alpha"], int | float)
        or not all(
            isinstance(lora.get(k, True), bool)
            for k in fields - {"rank", "alpha", "seed", "optimizer"}
        )
        or not isinstance(lora.get("seed", 0), int)
        or lora.get("optimizer", "adamw") not in OPTIMIZERS
    ):
        raise ValidationError(f"{TREADLE_CONFIG} has a malformed 'lora' entry: {lora!r}")
    return LoraSpec(**lora), config.get("base_model")


def _peft_spec(config: Mapping[str, Any]) -> tuple[LoraSpec, str | None]:
    """The `LoraSpec` of a plain peft LoRA config, if Treadle can run it as one."""
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}, not 'LORA'")
    for key, fine in (
        ("use_rslora", False),
        ("use_dora", False),
        ("fan_in_fan_out", False),
        ("bias", "none"),
    ):
        if config.get(key, fine) != fine:
            problems.append(f"{key} is {config.get(key)!r}; only {fine!r} is supported")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if config.get(key):
            problems.append(f"{key} is set; per-layer settings are not supported")
    # Which parts the suffixes name; that they cover each part whole (q_proj without k_proj, say)
    # is checked when the tensors are loaded into an adapter built for the model.
    # MoE experts' 3-D parameters (peft's `target_parameters`, e.g. `experts.gate_up_proj`) are
    # MLP targets, by their last name component.
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    parameters = config.get("target_parameters") or []
    categories: set[Category | None] = set()
    if not isinstance(parameters, list) or not all(isinstance(p, str) for p in parameters):
        problems.append(f"target_parameters is {parameters!r}; it must be a list of names")
        parameters = []
    if targets is None and parameters:
        targets = []
    if (
        isinstance(targets, list)
        and (targets or parameters)
        and all(isinstance(t, str) for t in targets)
    ):
        suffixes = [*targets, *(p.rsplit(".", 1)[-1] for p in parameters)]
        categories = {suffix_category(t) for t in suffixes}
        if strangers := sorted(t for t in targets if suffix_category(t) is None):
            problems.append(
                f"target_modules names {strangers}, which are no attention, MLP or unembedding "
                "linear Treadle knows"
            )
        if strangers := sorted(
            p for p in parameters if suffix_category(p.rsplit(".")[-1]) != "mlp"
        ):
            problems.append(
                f"target_parameters names {strangers}, which are no MoE expert parameter "
                "Treadle knows (gate_up_proj, up_proj, down_proj)"
            )
    else:
        problems.append(
            f"target_modules is {targets!r}; it must be a list of module-name suffixes such as "
            "['q_proj', 'k_proj', 'v_proj', 'o_proj']"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or not isinstance(alpha, int | float):
        problems.append(f"r {rank!r} and lora_alpha {alpha!r} must be numbers")
    if problems:
        raise ValidationError(f"{ADAPTER_CONFIG} cannot be loaded: " + "; ".join(problems))
    assert isinstance(rank, int) and isinstance(alpha, int | float)
    spec = LoraSpec(
        rank=rank,
        alpha=float(alpha),
        train_attn="attn" in categories,
        train_mlp="mlp" in categories,
        train_unembed="unembed" in categories,
    )
    return spec, config.get("base_model_name_or_path") or None


def _load_safetensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            return [(key, f.get_tensor(key)) for key in f.keys()]  # noqa: SIM118  # not a dict
    except Exception as exc:  # safetensors raises its own error types
        raise ValidationError(f"cannot read {path.name}: {exc}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValidationError(f"cannot read {path.name}: {exc}") from None
    if not isinstance(config, dict):
        raise ValidationError(f"{path.name} does not hold a JSON object")
    return config


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()
