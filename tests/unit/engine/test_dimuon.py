"""Dimuon (`engine/dimuon.py`), checked against the optimizer written out in plain NumPy
(float64, sharing no code with the engine): ten engine steps on the tiny debug model, an
experts tensor orthogonalised expert by expert, export/import continuing bit for bit, and a step or saved state of the other optimizer refused without changing anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import DATA, TINY, new_adapter, randomise_b
from torch import nn

from treadle.engine import AdamSpec, DimuonSpec, Engine, LoraSpec
from treadle.engine.lora import files as adapter_files
from treadle.engine.lora.adapters import LoraWeights, TrainableLora
from treadle.platform.errors import ValidationError

DIMUON_LORA = LoraSpec(rank=4, alpha=8.0, seed=3, optimizer="dimuon")
SPEC = DimuonSpec(learning_rate=1e-2, beta1=0.9, grad_clip_norm=1.0)
# The written-out reference runs in float64; the engine keeps weights and momentum in float32
# (its Newton-Schulz runs in float64). Weights agree within 1e-6 of the tensor's largest entry
# after ten steps (measured ~3e-7); the momentum within 1e-5, as it carries the clipping
# coefficient, which the engine takes from the float32 norm of ~10^5 grads (~4e-6 off).
TOLERANCE = 1e-6
MOMENTUM_TOLERANCE = 1e-5


def written_out_msign(m: np.ndarray) -> np.ndarray:
    """Muon's quintic Newton-Schulz, five steps, (a, b, c) = (3.4445, -4.7750, 2.0315), on the
    wide orientation of `m` scaled to Frobenius norm 1 (eps 1e-7)."""
    x = m.T if m.shape[0] > m.shape[1] else m
    x = x / (np.sqrt((x * x).sum()) + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    return x.T if m.shape[0] > m.shape[1] else x


class WrittenOutDimuon:
    """clip the grads' global norm (torch's rule: scale max / (norm + 1e-6), never above 1);
    per LoRA matrix: m <- b1 m + (1 - b1) g; o = msign(m) scaled to Frobenius sqrt(rank);
    w <- w - lr o."""

    def __init__(self, weights: Mapping[str, np.ndarray], rank: int) -> None:
        self.w = {n: np.asarray(a, np.float64).copy() for n, a in weights.items()}
        self.m = {n: np.zeros_like(a) for n, a in self.w.items()}
        self.rank = rank

    def step(self, grads: Mapping[str, np.ndarray], spec: DimuonSpec) -> None:
        g64 = {n: np.asarray(g, np.float64) for n, g in grads.items()}
        norm = math.sqrt(sum(float((g**2).sum()) for g in g64.values()))
        if spec.grad_clip_norm > 0:
            coef = min(1.0, spec.grad_clip_norm / (norm + 1e-6))
            g64 = {n: g * coef for n, g in g64.items()}
        for name, g in g64.items():
            self.m[name] = spec.beta1 * self.m[name] + (1 - spec.beta1) * g
            o = written_out_msign(self.m[name])
            o = o * math.sqrt(self.rank) / (np.sqrt((o * o).sum()) + 1e-7)
            self.w[name] = self.w[name] - spec.learning_rate * o


def assert_close(
    actual: object, expected: np.ndarray, name: str, tolerance: float = TOLERANCE
) -> None:
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(
        np.asarray(actual), expected, rtol=0, atol=tolerance * scale, err_msg=name
    )


def test_ten_engine_steps_equal_written_out_dimuon(engine: Engine, tmp_path: Path) -> None:
    adapter = new_adapter(engine, DIMUON_LORA)
    randomise_b(engine, adapter, seed=7)  # B != 0, so A's grads are not 0
    reference = WrittenOutDimuon(engine.adapter_weights(adapter), DIMUON_LORA.rank)
    for step in range(10):
        engine.forward_backward(adapter, DATA[step % 2 :], "cross_entropy")
        grads = engine.adapter_grads(adapter)
        reference.step(grads, SPEC)
        metrics = engine.optim_step(adapter, SPEC)
        expected_norm = math.sqrt(
            sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values())
        )
        assert metrics["grad_norm:mean"] == pytest.approx(expected_norm, rel=1e-5)
        assert metrics["learning_rate:mean"] == SPEC.learning_rate
    assert expected_norm > SPEC.grad_clip_norm  # the clipping was exercised
    engine.export_adapter(adapter, tmp_path, with_optimizer=True)
    saved = adapter_files.read_adapter(tmp_path, TINY, with_optimizer=True)
    assert saved.spec.optimizer == "dimuon" and saved.optimizer is not None
    for name, weight in engine.adapter_weights(adapter).items():
        assert_close(weight, reference.w[name], name)
        assert set(saved.optimizer[name]) == {"momentum_buffer"}
        m = saved.optimizer[name]["momentum_buffer"]
        assert_close(m, reference.m[name], name + ".m", MOMENTUM_TOLERANCE)


def test_each_expert_is_orthogonalised_on_its_own() -> None:
    """An experts tensor holds one LoRA pair per expert (A [E*r, in], B [out, r*E] with expert
    e's columns e, e+E, ..): each expert's block gets its own sqrt(rank) direction."""
    experts, rank = 3, 2
    g = torch.Generator().manual_seed(0)
    a = nn.Parameter(torch.randn(experts * rank, 5, generator=g))
    b = nn.Parameter(torch.randn(7, rank * experts, generator=g))
    start_a, start_b = a.detach().double().numpy().copy(), b.detach().double().numpy().copy()
    lora = TrainableLora(LoraWeights(scale=1.0, A={"e": a}, B={"e": b}), "dimuon", rank)
    a.grad, b.grad = torch.randn(a.shape, generator=g), torch.randn(b.shape, generator=g)
    grads_a, grads_b = a.grad.double().numpy(), b.grad.double().numpy()
    lora.step(DimuonSpec(learning_rate=0.1, beta1=0.5))
    for e in range(experts):
        rows = slice(e * rank, (e + 1) * rank)
        o = written_out_msign(0.5 * grads_a[rows])
        o *= math.sqrt(rank) / np.sqrt((o * o).sum())
        assert_close(a.detach()[rows].numpy(), start_a[rows] - 0.1 * o, f"A expert {e}")
        cols = slice(e, None, experts)
        o = written_out_msign(0.5 * grads_b[:, cols])
        o *= math.sqrt(rank) / np.sqrt((o * o).sum())
        assert_close(b.detach()[:, cols].numpy(), start_b[:, cols] - 0.1 * o, f"B expert {e}")


def test_a_zero_grad_moves_nothing() -> None:
    """A fresh adapter's first step: B = 0 gives A a zero grad, so A stays exactly."""
    a = nn.Parameter(torch.randn(2, 5))
    b = nn.Parameter(torch.zeros(3, 2))
    lora = TrainableLora(LoraWeights(scale=1.0, A={"m": a}, B={"m": b}), "dimuon", 2)
    before = a.detach().clone()
    a.grad, b.grad = torch.zeros_like(a), torch.randn(3, 2)
    lora.step(SPEC)
    assert torch.equal(a.detach(), before)
    assert float(torch.linalg.matrix_norm(b.detach())) == pytest.approx(
        SPEC.learning_rate * math.sqrt(2), rel=1e-5
    )


def train(engine: Engine, adapter: str, steps: int, spec: DimuonSpec = SPEC) -> None:
    for step in range(steps):
        engine.forward_backward(adapter, DATA[step % 3 :], "cross_entropy")
        engine.optim_step(adapter, spec)


def test_export_then_import_continues_bit_for_bit(engine: Engine, tmp_path: Path) -> None:
    adapter = new_adapter(engine, DIMUON_LORA)
    randomise_b(engine, adapter, seed=8)
    train(engine, adapter, 2)
    engine.export_adapter(adapter, tmp_path, with_optimizer=True)
    restored = f"{adapter}-restored"
    engine.import_adapter(restored, TINY, tmp_path, with_optimizer=True)
    assert engine.state_hashes(restored) == engine.state_hashes(adapter)
    train(engine, adapter, 3)
    train(engine, restored, 3)
    assert engine.state_hashes(restored) == engine.state_hashes(adapter)


def test_an_adam_step_on_a_dimuon_adapter_is_refused_changing_nothing(engine: Engine) -> None:
    adapter = new_adapter(engine, DIMUON_LORA)
    engine.forward_backward(adapter, DATA, "cross_entropy")
    before = engine.state_hashes(adapter)
    with pytest.raises(ValidationError, match="trains with dimuon, not adamw; send DimuonParams"):
        engine.optim_step(adapter, AdamSpec(learning_rate=1e-2))
    assert engine.state_hashes(adapter) == before
    adam = new_adapter(engine)
    with pytest.raises(ValidationError, match="trains with adamw, not dimuon; send AdamParams"):
        engine.optim_step(adam, SPEC)


def test_saved_state_of_the_other_optimizer_is_refused(engine: Engine, tmp_path: Path) -> None:
    """A checkpoint's weights load into either optimizer; its optimizer state only into its
    own."""
    adapter = new_adapter(engine)
    train_adam = AdamSpec(learning_rate=1e-2)
    engine.forward_backward(adapter, DATA, "cross_entropy")
    engine.optim_step(adapter, train_adam)
    engine.export_adapter(adapter, tmp_path, with_optimizer=True)
    with pytest.raises(ValidationError, match="optimizer state is adamw's, not dimuon's"):
        engine.import_adapter("x", TINY, tmp_path, with_optimizer=True, optimizer="dimuon")
    assert not engine.has_adapter("x")
    engine.import_adapter("y", TINY, tmp_path, with_optimizer=False, optimizer="dimuon")
    assert engine.state_hashes("y", ("weights",)) == engine.state_hashes(adapter, ("weights",))
    engine.forward_backward("y", DATA, "cross_entropy")
    engine.optim_step("y", SPEC)
    weights = LoraWeights(
        scale=1.0, A={"m": nn.Parameter(torch.ones(2, 3))}, B={"m": nn.Parameter(torch.ones(4, 2))}
    )
    lora = TrainableLora(weights, "dimuon", 2)
    name, tensor = weights.tensors()[0]
    adam_state = {"step": torch.tensor(1.0), "exp_avg": tensor, "exp_avg_sq": tensor}
    with pytest.raises(ValidationError, match="not the dimuon state"):
        lora.load_optimizer_state({name: adam_state})
