"""One fixed training loop through Treadle's SDK, run step by step so a test can strike between or
during steps, and what it ends with: every loss, every sample and the final weights and optimizer
state (downloaded as the user would), to compare bit for bit with an uninterrupted run."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import sqlalchemy as sa
from safetensors.numpy import load_file

import treadle
from tests.fault.conftest import Up, wait_for
from treadle.worker import faults

STEPS = 9
BASE_MODEL = "treadle/tiny-debug"
SAMPLE_EVERY = 4


def batch(step: int) -> list[treadle.Datum]:
    """Two datums whose tokens depend on the step, so every step's gradient differs."""
    data = []
    for row in range(2):
        ids = [(7 * step + 13 * row + 3 * i) % 250 + 1 for i in range(12)]
        data.append(
            treadle.Datum(
                model_input=treadle.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return data


@dataclass
class Outcome:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    samples: list[list[int]] = field(default_factory=list)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer: dict[str, np.ndarray] = field(default_factory=dict)


class Loop:
    """The loop on one training session; `step(i)` runs step i (forward_backward + optim_step,
    and every SAMPLE_EVERY steps a fresh sampler and one seeded sample)."""

    def __init__(self, up: Up, *, name: str, tc: Any = None, svc: Any = None) -> None:
        self.up = up
        self.svc = svc or treadle.ServiceClient(base_url=up.base_url, api_key=up.admin_key)
        self.tc = tc or self.svc.create_lora_training_client(
            BASE_MODEL, training_session_name=name, rank=8, alpha=16, seed=3
        )
        self.out = Outcome()

    @property
    def model_id(self) -> str:
        return str(self.tc.model_id)

    def close(self) -> None:
        """End the SDK's client session (its heartbeat stops; its sessions stop)."""
        self.svc.close()

    def submit(self, step: int) -> tuple[Any, Any]:
        fb = self.tc.forward_backward(batch(step), loss_fn="cross_entropy")
        opt = self.tc.optim_step(treadle.AdamParams(learning_rate=1e-2))
        return fb, opt

    def collect(self, step: int, futures: tuple[Any, Any]) -> None:
        fb, opt = futures
        self.out.losses.append(fb.result().metrics["loss:sum"])
        self.out.grad_norms.append(opt.result().metrics["grad_norm:mean"])
        if step % SAMPLE_EVERY == SAMPLE_EVERY - 1:
            sc = self.tc.save_weights_and_get_sampling_client()
            params = treadle.SamplingParams(max_tokens=6, temperature=1.0, seed=step)
            result = sc.sample([5, 6, 7], num_samples=1, sampling_params=params).result()
            self.out.samples.append(list(result.sequences[0].tokens))

    def step(self, step: int) -> None:
        self.collect(step, self.submit(step))

    def run(self, steps: range, strike: Callable[[int], None] | None = None) -> None:
        for i in steps:
            if strike is not None:
                strike(i)
            self.step(i)

    def finish(self, name: str = "final", strike: Callable[[], object] | None = None) -> Outcome:
        """Save the state and read it back as the user would: through the checkpoint download.
        `strike` runs once the save is sent."""
        future = self.tc.save_state(name)
        if strike is not None:
            strike()
        path = future.result().path
        with tempfile.TemporaryDirectory() as tmp:
            self.svc.checkpoints.download(path, Path(tmp))
            self.out.weights = load_file(str(Path(tmp) / "adapter_model.safetensors"))
            self.out.optimizer = load_file(str(Path(tmp) / "optimizer.safetensors"))
        return self.out

    # --- striking during an operation ---------------------------------------------------------

    def pause_next(self, op_type: str, seconds: float = 30.0) -> None:
        """The session's next `op_type` holds still after its effect, before its settlement."""
        client = redis.Redis.from_url(self.up.redis_url)
        faults.arm_pause(client, self.model_id, op_type, seconds)
        client.close()

    def wait_paused(self) -> int:
        """Wait until the armed operation is paused; returns its seq_id."""
        client = redis.Redis.from_url(self.up.redis_url)
        try:
            raw = wait_for(lambda: client.get(faults.paused_key(self.model_id)), 30, "the pause")
        finally:
            client.close()
        return int(raw)


def uninterrupted(up: Up) -> Outcome:
    """The loop run straight through: what every struck run must end with."""
    loop = Loop(up, name="reference")
    loop.run(range(STEPS))
    out = loop.finish()
    loop.close()
    return out


def assert_same(run: Outcome, reference: Outcome) -> None:
    """Bit for bit: losses, grad norms, samples, weights and optimizer state."""
    assert run.losses == reference.losses
    assert run.grad_norms == reference.grad_norms
    assert run.samples == reference.samples
    for got, want in ((run.weights, reference.weights), (run.optimizer, reference.optimizer)):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            assert got[name].tobytes() == want[name].tobytes(), f"{name} differs"


def assert_settled_once(up: Up, model_id: str) -> None:
    """Every requested operation was settled exactly once."""
    with up.db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT type, data->>'request_id' AS request_id FROM events "
                "WHERE session_id = :id AND type IN "
                "('OperationRequested', 'OperationCompleted', 'OperationFailed')"
            ),
            {"id": model_id},
        ).all()
    requested = [r.request_id for r in rows if r.type == "OperationRequested"]
    settled = [r.request_id for r in rows if r.type != "OperationRequested"]
    assert len(settled) == len(set(settled)), "an operation was settled twice"
    assert sorted(settled) == sorted(requested)
