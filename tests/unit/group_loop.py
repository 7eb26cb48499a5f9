"""One fixed training loop run on an engine, at any world size: what tests/unit/
test_worker_group.py compares. Run as a module, it is one rank of a worker group (torchrun's
environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): rank 0 drives the loop through a
`GroupEngine` and writes the result as JSON, the others follow.

    python -m tests.unit.group_loop CACHE_DIR OUT.json [LOAD_FOLDER]
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from treadle.gpu_worker.engine import AdamSpec, Engine, EngineDatum, LoraSpec  # noqa: E402
from treadle.platform.models.catalog import TINY_DEBUG_NAME  # noqa: E402

MICROBATCH_TOKENS = 96  # small parts, so a request splits across ranks
LORA = LoraSpec(rank=4, alpha=8.0, seed=7)
ADAM = AdamSpec(learning_rate=1e-2)
STEPS = 10


def datum(seed: int, n: int, rl: bool) -> EngineDatum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 49_000, n + 1)
    inputs: dict[str, np.ndarray] = {"target_tokens": tokens[1:].astype(np.int64)}
    if rl:
        inputs["logprobs"] = np.full(n, -3.0, np.float32)
        inputs["advantages"] = rng.normal(size=n).astype(np.float32)
    else:
        inputs["weights"] = np.ones(n, np.float32)
    return EngineDatum(tokens=tuple(int(t) for t in tokens[:-1]), loss_fn_inputs=inputs)


def run_loop(engine: Any, load: Path | None = None, save: Path | None = None) -> dict[str, Any]:
    """Ten steps of cross_entropy and ppo on six data of mixed lengths, an optimizer step each;
    every step's per-datum logprobs and losses and the state hashes after it. With `load`, the
    adapter starts from that export (weights and Adam state); with `save`, it is exported after
    five steps."""
    if load is None:
        engine.create_adapter("a", TINY_DEBUG_NAME, LORA)
    else:
        engine.import_adapter("a", TINY_DEBUG_NAME, load, with_optimizer=True)
    steps = []
    first = 0 if load is None else STEPS // 2
    for step in range(first, STEPS):
        loss = "ppo" if step % 3 == 2 else "cross_entropy"
        data = [
            datum(100 * step + i, n, loss == "ppo") for i, n in enumerate((40, 9, 33, 17, 60, 25))
        ]
        out = engine.forward_backward("a", data, loss)
        metrics = engine.optim_step("a", ADAM)
        steps.append(
            {
                "logprobs": [o["logprobs"].tolist() for o in out.outputs],
                "losses": [o["elementwise_loss"].tolist() for o in out.outputs],
                "loss": out.metrics["loss:sum"],
                "grad_norm": metrics["grad_norm:mean"],
                "state": engine.state_hashes("a"),
            }
        )
        if save is not None and step == STEPS // 2 - 1:
            engine.export_adapter("a", save, with_optimizer=True)
    return {"steps": steps, "weight_hash": engine.weight_hash("a")}


def main() -> None:
    from treadle.gpu_worker import group as worker_group

    cache_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    mode, folder = (sys.argv[3], Path(sys.argv[4])) if len(sys.argv) > 4 else ("", None)
    g = worker_group.init_from_env(timeout_seconds=120, device="cpu")
    engine = Engine(cache_dir=cache_dir, device="cpu", group=g, microbatch_tokens=MICROBATCH_TOKENS)
    if g.rank == 1 and os.environ.get("GROUP_LOOP_DRIFT"):  # a rank whose steps go elsewhere
        step = engine.optim_step
        engine.optim_step = lambda adapter_id, adam: step(  # type: ignore[method-assign]
            adapter_id, dataclasses.replace(adam, learning_rate=2 * adam.learning_rate)
        )
    if g.is_leader:
        leader = worker_group.GroupEngine(engine, g)
        try:
            result = run_loop(
                leader,
                load=folder if mode == "load" else None,
                save=folder if mode == "save" else None,
            )
        finally:
            leader.close()
        out.write_text(json.dumps(result))
    else:
        worker_group.follow(engine)
    worker_group.leave()


if __name__ == "__main__":
    main()
