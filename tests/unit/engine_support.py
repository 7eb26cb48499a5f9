"""Shared pieces of the engine tests: the tiny model's name, data, small helpers, and an
independent reference (the bare base model in plain PyTorch with the LoRA delta added by hand)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from treadle.engine import AdamSpec, Engine, EngineDatum, LoraSpec  # noqa: E402
from treadle.engine.models import loading as models  # noqa: E402
from treadle.platform.models.catalog import TINY_DEBUG_NAME  # noqa: E402
from treadle.platform.models.tokenizers import load_tokenizer  # noqa: E402

TINY = TINY_DEBUG_NAME
LORA = LoraSpec(rank=4, alpha=8.0, seed=3)
ADAM = AdamSpec(learning_rate=1e-2)
# For comparing gradients through a step: with eps = 1 the first Adam update is g / (|g| + 1),
# smooth in g. With a tiny eps it is ~sign(g), which turns float noise on near-zero grads into
# full-size differences.
GRAD_PROBE = AdamSpec(learning_rate=1.0, eps=1.0)
PROMPT = [1, 9690, 198, 2683, 359, 253]


def shared_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's model cache; the same folder as test_catalog's, so the tokenizer is built
    once per test session."""
    path = tmp_path_factory.getbasetemp() / "treadle-cache"
    path.mkdir(exist_ok=True)
    return path


_counter = itertools.count()


def new_adapter(engine: Engine, lora: LoraSpec = LORA) -> str:
    adapter_id = f"adapter-{next(_counter)}"
    engine.create_adapter(adapter_id, TINY, lora)
    return adapter_id


def ce_datum(tokens: Sequence[int], weights: Sequence[float] | None = None) -> EngineDatum:
    """A next-token datum over `tokens`: input tokens[:-1], targets tokens[1:]."""
    n = len(tokens) - 1
    w = np.ones(n, np.float32) if weights is None else np.asarray(weights, np.float32)
    return EngineDatum(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": w},
    )


DATA = [
    ce_datum([5, 17, 923, 4001, 12, 8]),
    ce_datum([100, 200, 300], [1.0, 0.5]),
    ce_datum([7, 7, 7, 7, 7, 7, 7, 7, 9]),
    ce_datum([49151, 0, 31, 2]),
]


def logprobs(engine: Engine, adapter_id: str, data: Sequence[EngineDatum]) -> list[np.ndarray]:
    out = engine.forward_backward(adapter_id, data, "cross_entropy", forward_only=True)
    return [o["logprobs"] for o in out.outputs]


def train(
    engine: Engine,
    adapter_id: str,
    steps: int,
    data: Sequence[EngineDatum] = DATA,
    adam: AdamSpec = ADAM,
) -> list[float]:
    """`steps` cross-entropy steps; the loss before each."""
    losses = []
    for _ in range(steps):
        losses.append(
            engine.forward_backward(adapter_id, data, "cross_entropy").metrics["loss:sum"]
        )
        engine.optim_step(adapter_id, adam)
    return losses


def randomise_b(engine: Engine, adapter_id: str, seed: int, std: float = 0.05) -> None:
    """Give the adapter small random B matrices (a fresh one has B = 0, so dL/dA = 0)."""
    rng = np.random.default_rng(seed)
    weights = engine.adapter_weights(adapter_id)
    for name, array in weights.items():
        if ".lora_B." in name:
            weights[name] = rng.normal(0.0, std, array.shape).astype(np.float32)
    engine.set_adapter_weights(adapter_id, weights)


# -- the independent reference -------------------------------------------------------------------

_PREFIX, _A, _B = "base_model.model.", ".lora_A.weight", ".lora_B.weight"


class HandLora:
    """An adapter's A/B as leaf tensors (requires_grad), keyed by the base model's module name,
    copied out of the engine as plain arrays."""

    def __init__(self, arrays: Mapping[str, np.ndarray], scale: float) -> None:
        self.scale = scale
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        for name, array in arrays.items():
            tensor = torch.tensor(array, requires_grad=True)
            if name.endswith(_A):
                self.A[name.removeprefix(_PREFIX).removesuffix(_A)] = tensor
            else:
                self.B[name.removeprefix(_PREFIX).removesuffix(_B)] = tensor

    def grads(self, loss: torch.Tensor) -> dict[str, np.ndarray]:
        """d loss / d every A and B, under the engine's (peft) names."""
        modules = sorted(self.A)
        leaves = [self.A[m] for m in modules] + [self.B[m] for m in modules]
        grads = torch.autograd.grad(loss, leaves)
        out = {}
        for m, g_a, g_b in zip(modules, grads[: len(modules)], grads[len(modules) :], strict=True):
            out[_PREFIX + m + _A] = g_a.numpy()
            out[_PREFIX + m + _B] = g_b.numpy()
        return out


_bare: dict[Path, LlamaForCausalLM] = {}


def bare_model(cache_dir: Path) -> LlamaForCausalLM:
    """A freshly built tiny model with no LoRA machinery, frozen, float32 on the CPU."""
    if cache_dir not in _bare:
        model = models.build_tiny_debug(load_tokenizer(TINY, cache_dir)).eval()
        _bare[cache_dir] = model.requires_grad_(False)
    return _bare[cache_dir]


def reference_logprobs(
    cache_dir: Path, tokens: Sequence[int], targets: Sequence[int], lora: HandLora | None = None
) -> torch.Tensor:
    """log p(targets[i] | tokens[:i+1]) in plain PyTorch: each LoRA target linear's output gets
    `scale * x @ A.T @ B.T` added by a forward hook. Differentiable w.r.t. `lora`'s tensors."""
    model = bare_model(cache_dir)
    handles = []
    for name in lora.A if lora is not None else ():
        assert lora is not None
        hook = _delta_hook(lora.A[name], lora.B[name], lora.scale)
        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        logits_T_V = model(torch.tensor([list(tokens)])).logits[0].float()
    finally:
        for handle in handles:
            handle.remove()
    targets_T = torch.tensor(list(targets))
    return torch.log_softmax(logits_T_V, dim=-1).gather(-1, targets_T[:, None])[:, 0]


def _delta_hook(
    a_r_in: torch.Tensor, b_out_r: torch.Tensor, scale: float
) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]:
    def hook(_: torch.nn.Module, inputs: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
        return y + (inputs[0] @ a_r_in.T @ b_out_r.T) * scale

    return hook
