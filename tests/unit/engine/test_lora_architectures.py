"""LoRA on every architecture Treadle is tested on (tiny random models of `tests/architectures.py`,
the eight once admitted by name and those admitted by structure): Treadle adapts the modules peft
adapts (with Treadle's suffixes, and peft's own `all-linear` choice; MoE experts stored as 3-D
parameters as peft's `target_parameters` adapts them, one LoRA per expert), its loss and LoRA
gradients equal peft's, its exports load in plain peft and transformers, and the engine resolves a
refused architecture's blocks as registration did."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.architectures import ARCHITECTURES, MOE, build, config
from treadle.engine.lora import files as adapter_files
from treadle.engine.lora.adapters import LoraHost, LoraSpec, LoraWeights
from treadle.engine.lora.targets import (
    ATTN_SUFFIXES,
    MLP_SUFFIXES,
    UNEMBED_SUFFIXES,
    expert_key,
    resolve,
    suffix_category,
)
from treadle.engine.losses.functions import EngineDatum, batch_loss, get_loss, validate_data
from treadle.platform.errors import ValidationError
from treadle.platform.models.losses import resolve_config

pytestmark = [
    # peft's advice on tied embeddings (Gemma 3) and its saving of lm_head's base weight
    pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning"),
    pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning"),
    # peft 0.21's PeftModel asks transformers 5 for a deprecated attribute
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

CPU = torch.device("cpu")
DENSE = tuple(a for a in ARCHITECTURES if a not in MOE)
FLAGS = [f for f in itertools.product([True, False], repeat=3) if any(f)]  # attn, mlp, unembed
# Two rows of different lengths (padding), longer than the 16-token sliding windows.
TOKENS = ([(7 * i + 3) % 256 for i in range(21)], [(11 * i + 5) % 256 for i in range(14)])
CROSS_ENTROPY = get_loss("cross_entropy")


def spec_for(arch: str, attn: bool = True, mlp: bool = True, unembed: bool = True) -> LoraSpec:
    """Rank 4, alpha 8."""
    return LoraSpec(4, 8.0, seed=1, train_attn=attn, train_mlp=mlp, train_unembed=unembed)


def random_weights(host: LoraHost, spec: LoraSpec) -> LoraWeights:
    """The host's fresh weights for `spec` with B random too, so every delta is nonzero."""
    weights = host.new_weights(spec, CPU)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for b_out_r in weights.B.values():
            b_out_r.copy_(torch.randn(b_out_r.shape, generator=generator) * 0.1)
    return weights


def peft_twin(arch: str, spec: LoraSpec, weights: LoraWeights) -> PeftModel:
    """A fresh model of `arch` under peft with the suffixes (`target_modules`) and expert
    parameters (`target_parameters`) Treadle resolves, and `weights`, copied in by name: peft's
    names of its LoRA tensors are the names Treadle gives them."""
    model = build(arch)
    targets = resolve(model)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(targets.suffixes(spec)),
        target_parameters=list(targets.parameter_suffixes(spec)) or None,
        lora_dropout=0.0,
    )
    twin = get_peft_model(model, config)
    ours, theirs = dict(weights.tensors()), peft_tensors(twin)
    assert set(ours) == set(theirs)
    with torch.no_grad():
        for name, tensor in theirs.items():
            tensor.copy_(ours[name])
    return twin


def peft_tensors(twin: PeftModel) -> dict[str, nn.Parameter]:
    """peft's LoRA tensors under the names it saves them with."""
    return {n.replace(".default.", "."): p for n, p in twin.named_parameters() if ".lora_" in n}


def peft_adapted(model: nn.Module) -> set[str]:
    return {
        name.removeprefix("base_model.model.")
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }


def reference_loss(model: nn.Module) -> torch.Tensor:
    """Summed cross-entropy of TOKENS (each token predicting the next), plain PyTorch."""
    width = max(len(t) for t in TOKENS)
    tokens_B_T = torch.tensor([t + [0] * (width - len(t)) for t in TOKENS])
    mask_B_T = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in TOKENS])
    logits_B_T_V = model(input_ids=tokens_B_T, attention_mask=mask_B_T, use_cache=False).logits
    logprobs_B_T_V = torch.log_softmax(logits_B_T_V.float(), -1)
    targets_B_T = torch.roll(tokens_B_T, -1, dims=1)
    picked_B_T = logprobs_B_T_V.gather(-1, targets_B_T[..., None])[..., 0]
    keep_B_T = torch.tensor([[i < len(t) - 1 for i in range(width)] for t in TOKENS])
    return -(picked_B_T * keep_B_T).sum()


def treadle_loss(model: PreTrainedModel) -> torch.Tensor:
    """The same loss through the engine's `batch_loss` (the last token of a row predicts
    nothing: its weight is 0)."""
    data = [
        EngineDatum(
            tokens=tuple(t),
            loss_fn_inputs={
                "target_tokens": np.array(t[1:] + [0], np.int64),
                "weights": np.array([1.0] * (len(t) - 1) + [0.0], np.float32),
            },
        )
        for t in TOKENS
    ]
    arrays = validate_data(data, CROSS_ENTROPY, vocab_size=256, max_context_length=512)
    _, loss = batch_loss(model, arrays, CROSS_ENTROPY, resolve_config(CROSS_ENTROPY.spec, None))
    return loss


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([TOKENS[0]]), use_cache=False).logits[0].float()


# -- which modules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "flags"),
    [(a, f) for a in ARCHITECTURES for f in FLAGS],
    ids=lambda x: x if isinstance(x, str) else "-".join("amu"[i] for i in range(3) if x[i]),
)
def test_treadle_adapts_the_modules_peft_adapts(arch: str, flags: tuple[bool, bool, bool]) -> None:
    """Same tensors, same names and shapes (`peft_twin` checks the names; `copy_` the shapes),
    and the same modules wrapped (an experts module once per adapted parameter in peft)."""
    spec = LoraSpec(4, 8.0, train_attn=flags[0], train_mlp=flags[1], train_unembed=flags[2])
    host = LoraHost(build(arch))
    weights = host.new_weights(spec, CPU)
    twin = peft_twin(arch, spec, weights)
    names = {
        n.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for n, _ in weights.tensors()
    }
    assert names == peft_adapted(twin)
    assert list(weights.A) == list(host.targets.for_spec(spec))


@pytest.mark.parametrize("arch", DENSE)
def test_a_dense_model_has_every_decoder_linear_and_lm_head_adapted(arch: str) -> None:
    model = build(arch)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    in_layers = {n for n in linears if n.startswith("model.layers.")}
    assert linears == in_layers | {"lm_head"}
    host = LoraHost(model)
    assert set(host.new_weights(spec_for(arch), CPU).A) == in_layers | {"lm_head"}
    assert host.targets.unknown == () and not host.targets.experts_3d


@pytest.mark.parametrize("arch", sorted(MOE))
def test_moe_models_have_attention_every_expert_parameter_and_lm_head_adapted(arch: str) -> None:
    """Every 3-D parameter of the MLPs (each layer's experts' gate_up_proj and down_proj) is an
    MLP target; the router's weights (`gate`, `router`: 2-D) never are."""
    model = build(arch)
    targets = resolve(model)
    assert targets.experts_3d
    stacked = [n for n, p in model.named_parameters() if p.dim() == 3]
    assert len(stacked) == 2 * model.config.num_hidden_layers
    assert list(targets.mlp) == list(targets.experts)
    assert targets.experts == tuple(expert_key(*n.rsplit(".", 1)) for n in stacked)
    routers = [n for n, _ in model.named_parameters() if ".gate." in n or ".router." in n]
    assert routers and not any(key.split(":")[0] in r for r in routers for key in targets.mlp)
    attention = {
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".self_attn." in n
    }
    assert set(targets.attn) == attention and targets.unembed == ("lm_head",)
    assert targets.unknown == ()


@pytest.mark.parametrize("arch", sorted(MOE))
def test_an_experts_module_of_another_layout_is_refused_not_skipped(arch: str) -> None:
    """Experts whose forward Treadle cannot follow (no transformers experts layout) refuse MLP
    training, naming their parameters; attention and unembedding still train."""
    model = build(arch)
    del model.model.layers[1].mlp.experts.is_transposed
    host = LoraHost(model)
    with pytest.raises(
        ValidationError, match=r"layers\.1\.mlp\.experts:gate_up_proj.*train_mlp=False"
    ):
        host.new_weights(LoraSpec(4, 8.0), CPU)
    assert host.new_weights(LoraSpec(4, 8.0, train_mlp=False), CPU).A


def test_a_category_that_matches_nothing_is_refused() -> None:
    model = build("llama3")
    model.lm_head = nn.Identity()  # type: ignore[assignment]  # no unembedding linear left
    host = LoraHost(model)
    with pytest.raises(ValidationError, match="no unembedding linear.*train_unembed=False"):
        host.new_weights(LoraSpec(4, 8.0), CPU)
    assert host.new_weights(LoraSpec(4, 8.0, train_unembed=False), CPU).A


def test_an_unknown_linear_in_a_block_is_refused_not_skipped() -> None:
    model = build("llama3")
    model.model.layers[1].self_attn.extra_proj = nn.Linear(4, 4)
    host = LoraHost(model)
    with pytest.raises(ValidationError, match="extra_proj.*train_attn=False"):
        host.new_weights(LoraSpec(4, 8.0), CPU)
    assert host.new_weights(LoraSpec(4, 8.0, train_attn=False), CPU).A


def test_every_suffix_belongs_to_one_category() -> None:
    tables = (ATTN_SUFFIXES, MLP_SUFFIXES, UNEMBED_SUFFIXES)
    for category, table in zip(("attn", "mlp", "unembed"), tables, strict=True):
        assert all(suffix_category(s) == category for s in table)
    assert suffix_category("gate") is None and suffix_category("router") is None


# -- same numbers as peft -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "flags"),
    [(a, (True, True, True)) for a in ARCHITECTURES]
    + [(a, (False, True, False)) for a in sorted(MOE)],
    ids=lambda x: x if isinstance(x, str) else "-".join("amu"[i] for i in range(3) if x[i]),
)
def test_loss_and_lora_grads_equal_peft(arch: str, flags: tuple[bool, bool, bool]) -> None:
    """On MoE models with the experts alone too (mlp only): their deltas change the loss."""
    spec = spec_for(arch, *flags)
    model = build(arch)
    host = LoraHost(model)
    weights = random_weights(host, spec)
    twin = peft_twin(arch, spec, weights)
    with host.use(weights):
        loss = treadle_loss(model)
        loss.backward()
    twin_loss = reference_loss(twin)
    twin_loss.backward()
    torch.testing.assert_close(loss, twin_loss, rtol=1e-6, atol=1e-5)  # 1 ulp of ~200
    with host.use(None), torch.no_grad():  # the adapter really changes the loss
        assert abs(treadle_loss(model).item() - loss.item()) > 1e-3
    theirs = peft_tensors(twin)
    for name, ours in weights.tensors():
        assert ours.grad is not None and theirs[name].grad is not None, name
        assert ours.grad.abs().max() > 0, name  # every tensor takes part
        torch.testing.assert_close(ours.grad, theirs[name].grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", DENSE)
def test_attention_and_mlp_equal_peft_on_the_modules_peft_chooses(arch: str) -> None:
    """peft's own choice, `target_modules="all-linear"` (every linear but the output layer), is
    what Treadle adapts with train_attn and train_mlp; loss and LoRA grads equal peft's."""
    spec = spec_for(arch, unembed=False)
    model = build(arch)
    host = LoraHost(model)
    weights = random_weights(host, spec)
    chosen = get_peft_model(
        build(arch), LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear", lora_dropout=0.0)
    )
    assert set(weights.A) == peft_adapted(chosen)
    with torch.no_grad():
        for name in weights.A:
            layer = chosen.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(weights.A[name])
            layer.lora_B["default"].weight.copy_(weights.B[name])
    with host.use(weights):
        loss = treadle_loss(model)
        loss.backward()
    theirs = reference_loss(chosen)
    theirs.backward()
    torch.testing.assert_close(loss, theirs, rtol=1e-6, atol=1e-5)
    for name in weights.A:
        layer = chosen.base_model.model.get_submodule(name)
        for ours, peft_w in (
            (weights.A[name], layer.lora_A["default"].weight),
            (weights.B[name], layer.lora_B["default"].weight),
        ):
            assert ours.grad is not None and peft_w.grad is not None, name
            torch.testing.assert_close(ours.grad, peft_w.grad, rtol=0, atol=1e-5)


def test_the_engine_finds_the_unknown_mlp_linears_registration_refuses() -> None:
    """Starcoder2 (refused at registration for model.layers.*.mlp.c_fc and c_proj): the engine's
    rules, the same tables, leave the same linears unknown and refuse MLP training."""
    model = build("starcoder2", cfg=config("starcoder2"))
    targets = resolve(model)
    assert {(c, n.split(".", 3)[-1]) for c, n in targets.unknown} == {
        ("mlp", "mlp.c_fc"), ("mlp", "mlp.c_proj")
    }  # fmt: skip
    with pytest.raises(ValidationError, match="c_fc.*train_mlp=False"):
        targets.for_spec(LoraSpec(4, 8.0))


# -- exports ------------------------------------------------------------------------------------


@pytest.fixture
def exported(arch: str, tmp_path: Path) -> tuple[Path, torch.Tensor, LoraSpec, LoraWeights]:
    """The saved base model, an adapter exported (peft folder) and Treadle's logits with it."""
    spec = spec_for(arch)
    model = build(arch)
    build(arch).save_pretrained(tmp_path / "base")
    host = LoraHost(model)
    weights = random_weights(host, spec)
    adapter_files.write_adapter(tmp_path / "adapter", str(tmp_path / "base"), spec, weights, None)
    with host.use(weights):
        want = logits(model)
    return tmp_path, want, spec, weights


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_peft_loads_the_exported_adapter(
    arch: str, exported: tuple[Path, torch.Tensor, LoraSpec, LoraWeights]
) -> None:
    folder, want, _, _ = exported
    base = AutoModelForCausalLM.from_pretrained(str(folder / "base")).eval()
    bare = logits(base)
    loaded = PeftModel.from_pretrained(base, str(folder / "adapter")).eval()
    torch.testing.assert_close(logits(loaded), want, rtol=0, atol=1e-5)
    assert (bare - want).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_merged_export_loads_with_transformers(
    arch: str, exported: tuple[Path, torch.Tensor, LoraSpec, LoraWeights]
) -> None:
    folder, want, _, weights = exported
    adapter_files.write_merged(folder / "merged", build(arch), weights.frozen_copy(), {})
    merged = AutoModelForCausalLM.from_pretrained(str(folder / "merged")).eval()
    torch.testing.assert_close(logits(merged), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_plain_peft_export_reads_back(
    arch: str, exported: tuple[Path, torch.Tensor, LoraSpec, LoraWeights]
) -> None:
    folder, _, spec, weights = exported
    (folder / "adapter" / adapter_files.TREADLE_CONFIG).unlink()
    saved = adapter_files.read_adapter(
        folder / "adapter", str(folder / "base"), with_optimizer=False
    )
    assert (saved.spec.train_attn, saved.spec.train_mlp, saved.spec.train_unembed) == (
        spec.train_attn, spec.train_mlp, spec.train_unembed,
    )  # fmt: skip
    fresh = LoraHost(build(arch)).new_weights(saved.spec, CPU)
    fresh.load(saved.tensors)
    for name, tensor in weights.tensors():
        torch.testing.assert_close(dict(fresh.tensors())[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("arch", "flags"),
    [(a, (True, True, True)) for a in ARCHITECTURES]
    + [(a, (False, True, False)) for a in sorted(MOE)],
    ids=lambda x: x if isinstance(x, str) else "-".join("amu"[i] for i in range(3) if x[i]),
)
def test_an_adapter_peft_saves_loads_into_treadle(
    arch: str, flags: tuple[bool, bool, bool], tmp_path: Path
) -> None:
    """On MoE models with the experts alone too: peft's config then has `target_modules` []
    and the experts in `target_parameters`."""
    spec = spec_for(arch, *flags)
    model = build(arch)
    host = LoraHost(model)
    weights = random_weights(host, spec)
    twin = peft_twin(arch, spec, weights)
    twin.save_pretrained(str(tmp_path))
    saved = adapter_files.read_adapter(tmp_path, "", with_optimizer=False)
    flags_read = (saved.spec.train_attn, saved.spec.train_mlp, saved.spec.train_unembed)
    assert flags_read == flags
    loaded = host.new_weights(saved.spec, CPU)
    loaded.load(saved.tensors)
    with host.use(loaded):
        torch.testing.assert_close(logits(model), logits(twin), rtol=0, atol=1e-5)
