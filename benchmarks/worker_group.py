"""forward_backward on a worker group at world sizes 1 and 2 (or any), in each layout: tokens per
second, the time rank 0 spends in the group's exchange (the parts' outputs and LoRA gradients
gathered to every rank, waiting for the slower rank included), and the base model's weights each
rank holds (the sharded layout splits every decoder layer across the ranks and gathers it for
each pass: its collectives are inside the passes' time).

Each world size runs the same requests (8 sequences, 4 parts) through the engine, rank 0 driving
the others through a GroupExecutor as a worker does; ranks are processes with torchrun's
environment, gloo on the CPU, NCCL on CUDA. The final adapter hash is printed per world size:
the runs are the same bit for bit. On a 2-core CPU this shows the cost of the machinery, not a
speed-up (two ranks share the two cores).

    python benchmarks/worker_group.py [--model NAME] [--steps N] [--world-sizes 1 2]
        [--layouts replicated sharded] [--device cpu|cuda] [--group-of-one]

On a machine with one GPU: `--device cuda --world-sizes 1 --group-of-one` runs the engine as a
one-rank NCCL group (the machinery, its exchange included, on the device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from treadle.engine import AdamSpec, Engine, EngineDatum, LoraSpec  # noqa: E402
from treadle.engine.distributed import group as worker_group  # noqa: E402
from treadle.engine.distributed.executor import GroupExecutor, follow  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.platform.models.catalog import SMOLLM2_NAME  # noqa: E402

SEQUENCES, LENGTH, PART_TOKENS = 8, 256, 512  # four parts of two sequences


def requests(step: int) -> list[EngineDatum]:
    rng = np.random.default_rng(step)
    data = []
    for _ in range(SEQUENCES):
        tokens = rng.integers(1, 49_000, LENGTH + 1)
        data.append(
            EngineDatum(
                tokens=tuple(int(t) for t in tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:].astype(np.int64),
                    "weights": np.ones(LENGTH, np.float32),
                },
            )
        )
    return data


def run(engine: object, model: str, steps: int) -> dict[str, object]:
    """`steps` forward_backward + optim_step calls (the first one a warm-up, not counted)."""
    engine.create_adapter("bench", model, LoraSpec(rank=16, alpha=32.0, seed=1))  # type: ignore[attr-defined]
    times = []
    for step in range(steps + 1):
        data = requests(step)
        started = time.perf_counter()
        engine.forward_backward("bench", data, "cross_entropy")  # type: ignore[attr-defined]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - started)
        engine.optim_step("bench", AdamSpec(learning_rate=1e-4))  # type: ignore[attr-defined]
    return {
        "base_mb": base_bytes(engine, model) / 2**20,
        "median_s": statistics.median(times),
        "tokens_per_s": SEQUENCES * LENGTH / statistics.median(times),
        "weight_hash": engine.weight_hash("bench"),  # type: ignore[attr-defined]
    }


def base_bytes(engine: object, model: str) -> int:
    """Bytes of `model`'s weights this rank holds (its shards only, in the sharded layout)."""
    inner = getattr(engine, "engine", engine)  # a GroupExecutor's own engine
    total = 0
    for p in inner._bases[model].model.parameters():  # type: ignore[attr-defined]
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def rank_main(args: argparse.Namespace) -> None:
    group = worker_group.init_from_env(timeout_seconds=600, device=args.device, layout=args.layout)
    engine = Engine(
        cache_dir=args.cache_dir, device=args.device, parallel=group, microbatch_tokens=PART_TOKENS
    )
    if group.is_leader:
        leader = GroupExecutor(engine, group)
        try:
            result = run(leader, args.model, args.steps)
        finally:
            leader.close()
        result["exchange_s_per_step"] = group.exchanged.seconds / max(1, group.exchanged.calls)
        args.out.write_text(json.dumps(result))
    else:
        follow(engine, group)
        worker_group.leave(engine)  # rank 0's close() left already


def world(args: argparse.Namespace, size: int, layout: str) -> dict[str, object]:
    if size == 1 and not args.group_of_one:
        engine = Engine(cache_dir=args.cache_dir, device=args.device, microbatch_tokens=PART_TOKENS)
        return {**run(engine, args.model, args.steps), "exchange_s_per_step": 0.0}
    out = args.cache_dir / f"world{size}-{layout}.json"
    port = str(free_port())
    procs = []
    for rank in range(size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": str(torch.get_num_threads())}  # fmt: skip
        argv = [sys.executable, __file__, "--rank-mode", "--out", str(out),
                "--cache-dir", str(args.cache_dir), "--model", args.model,
                "--steps", str(args.steps), "--device", args.device,
                "--layout", layout]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env))
    if any(p.wait() for p in procs):
        raise SystemExit(f"a rank of the world of {size} failed")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=SMOLLM2_NAME)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--layouts", nargs="+", default=list(worker_group.LAYOUTS), choices=worker_group.LAYOUTS,
        help="the layouts each world size above 1 runs in",
    )  # fmt: skip
    parser.add_argument("--layout", default="replicated", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument(
        "--group-of-one", action="store_true",
        help="world size 1 as a process group of one rank too (NCCL on a single GPU)",
    )  # fmt: skip
    parser.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_mode:
        rank_main(args)
        return 0
    args.cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="treadle-group-bench-"))
    print(f"{args.model}, {SEQUENCES} x {LENGTH} tokens a request in parts of {PART_TOKENS}, "
          f"{args.device}, {torch.get_num_threads()} threads a rank")  # fmt: skip
    print(
        "| world size | layout | base weights a rank | forward_backward p50 | tokens/s "
        "| exchange per call | adapter hash |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    hashes = set()
    for size in args.world_sizes:
        for layout in args.layouts if size > 1 or args.group_of_one else ["replicated"]:
            r = world(args, size, layout)
            hashes.add(r["weight_hash"])
            print(
                f"| {size} | {layout} | {float(r['base_mb']):.0f} MB "
                f"| {float(r['median_s']) * 1e3:.0f} ms | {float(r['tokens_per_s']):.0f} "
                f"| {float(r['exchange_s_per_step']) * 1e3:.1f} ms "
                f"| {str(r['weight_hash'])[:12]} |"
            )
    print("same adapter at every world size" if len(hashes) == 1 else "ADAPTERS DIFFER")
    return 0 if len(hashes) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
