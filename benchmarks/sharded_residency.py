"""How much of a base model each rank of a sharded worker group holds after a forward, after a
training step and after a sample: its shard of every decoder layer, the layers FSDP still holds
gathered, and what stays whole (embeddings, final norm, output head), against the whole model.

Two ranks (gloo on the CPU, one process each, torchrun's environment) run the engine in the
sharded layout, rank 0 driving through a `GroupExecutor` as a worker does.

    python benchmarks/sharded_residency.py [--model NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MIB = 2**20


def resident(engine: Any, model_name: str) -> dict[str, float]:
    """This rank's bytes of the base model: layers' shards, layers held gathered, the rest."""
    model = engine._bases[model_name].model
    layers = model.get_decoder().layers
    in_layers = {id(p) for p in layers.parameters()}
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_layers)
    shards = gathered = 0
    for layer in layers:
        group = layer._get_fsdp_state()._fsdp_param_group
        for param in (fsdp.sharded_param for fsdp in group.fsdp_params):  # DTensors
            shards += param.to_local().numel() * param.element_size()
            if group.is_unsharded:  # the whole layer is held gathered too
                gathered += param.numel() * param.element_size()
    held = rest + shards + gathered
    return {"whole_mib": whole / MIB, "held_mib": held / MIB, "fraction": held / whole}


def rank_main(model_name: str, cache_dir: Path, out: Path) -> None:
    import numpy as np

    from treadle.engine import (
        Engine,
        EngineDatum,
        GroupExecutor,
        LoraSpec,
        SampleRequest,
        SamplingSpec,
        follow,
    )
    from treadle.engine.distributed import group as worker_group

    group = worker_group.init_from_env(timeout_seconds=600, device="cpu", layout="sharded")
    engine = Engine(cache_dir=cache_dir, device="cpu", parallel=group)
    if not group.is_leader:
        follow(engine, group)
        worker_group.leave(engine)
        return
    leader = GroupExecutor(engine, group)
    try:
        leader.create_adapter("a", model_name, LoraSpec(rank=16, alpha=32.0, seed=1))
        rng = np.random.default_rng(0)
        tokens = rng.integers(1, 49_000, 257)
        data = [
            EngineDatum(
                tuple(int(t) for t in tokens[:-1]),
                {"target_tokens": tokens[1:].astype(np.int64), "weights": np.ones(256)},
            )
        ]
        result = {"loaded": resident(engine, model_name)}
        leader.forward_backward("a", data, "cross_entropy", forward_only=True)
        result["after a forward"] = resident(engine, model_name)
        leader.forward_backward("a", data, "cross_entropy")
        result["after a training step"] = resident(engine, model_name)
        leader.snapshot("a", "s")
        request = SampleRequest(model_name, "s", (5, 6, 7), 2, SamplingSpec(max_tokens=8, seed=1))
        leader.sample_batch([request])
        result["after a sample"] = resident(engine, model_name)
    finally:
        leader.close()
    out.write_text(json.dumps(result))


def main() -> int:
    from treadle.platform.embedded import free_port
    from treadle.platform.models.catalog import SMOLLM2_NAME

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=SMOLLM2_NAME)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or Path(tmp)
        if args.rank_mode:
            rank_main(args.model, cache_dir, args.out)
            return 0
        out, port = Path(tmp) / "out.json", str(free_port())
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank-mode",
                    "--model",
                    args.model,
                    "--cache-dir",
                    str(cache_dir),
                    "--out",
                    str(out),
                ],
                env={
                    **os.environ,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                },
            )  # fmt: skip
            for rank in range(2)
        ]
        if any(p.wait() for p in procs):
            raise SystemExit("a rank failed")
        for when, r in json.loads(out.read_text()).items():
            print(
                f"{when:>22}: rank 0 holds {r['held_mib']:7.1f} of {r['whole_mib']:7.1f} MiB "
                f"({r['fraction']:.2f} of the model)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
