"""Peak memory of one forward_backward as the number of datums grows: SmolLM2-135M, LoRA rank 32
on every attention and MLP linear, cross-entropy on datums of 256 tokens (8 and 64 by default).

A request runs in parts (about 682 tokens a pass for SmolLM2's 49,152-token vocabulary: two
datums); the gradient is added in one fixed tree as the parts finish (`treadle.engine.gradients`),
so the memory a call holds beyond one pass's is a logarithmic number of adapter-sized buffers,
not one per part. Each case runs in a fresh process: the peak is VmHWM, reset just before the
call, minus VmRSS then. `--against REV` runs the same cases on another commit (a git worktree
of REV, with this checkout's environment) and prints the largest difference of its losses and
gradients from this one's.

    python benchmarks/forward_backward_memory.py [--datums 8 64] [--against REV]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
LENGTH = 256
MIB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def child(datums: int, cache_dir: Path, out: Path) -> None:
    """One forward_backward of `datums` datums after a warm-up call; writes its peak, seconds,
    loss and gradients."""
    import numpy as np
    import torch

    from treadle.engine import Engine, EngineDatum, LoraSpec
    from treadle.platform.models.catalog import SMOLLM2_NAME

    def data(n: int, seed: int) -> list[EngineDatum]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            tokens = rng.integers(1, 49_000, LENGTH + 1)
            inputs = {"target_tokens": tokens[1:].astype(np.int64), "weights": np.ones(LENGTH)}
            out.append(EngineDatum(tuple(int(t) for t in tokens[:-1]), inputs))
        return out

    engine = Engine(cache_dir=cache_dir, device="cpu")
    engine.create_adapter("a", SMOLLM2_NAME, LoraSpec(rank=32, alpha=32.0, seed=1))
    with torch.no_grad():  # B random too, so that every gradient is nonzero
        weights = engine.adapter_weights("a")
        rng = np.random.default_rng(2)
        engine.set_adapter_weights(
            "a",
            {k: rng.standard_normal(v.shape).astype(np.float32) * 0.01 for k, v in weights.items()},
        )
    engine.forward_backward("a", data(2, 99), "cross_entropy", forward_only=True)  # warm-up
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    result = engine.forward_backward("a", data(datums, 0), "cross_entropy")
    seconds = time.perf_counter() - started
    peak = (_status_kib("VmHWM") - before) * 1024
    grads = engine.adapter_grads("a")
    np.savez(out.with_suffix(".npz"), **grads)
    adapter = sum(g.size for g in grads.values()) * 4
    out.write_text(
        json.dumps(
            {
                "peak_mib": peak / MIB,
                "seconds": seconds,
                "loss": result.metrics["loss:sum"],
                "adapter_mib": adapter / MIB,
            }
        )
    )


def run(root: Path, datums: int, cache_dir: Path, out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(root)}  # `treadle` imported from `root`
    subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            str(datums),
            "--cache-dir",
            str(cache_dir),
            "--out",
            str(out),
        ],
        env=env,
        check=True,
        cwd=root,
    )
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> int:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datums", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--against", default=None, help="a commit to compare with")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or Path(tmp) / "cache"
        if args.child is not None:
            child(args.child, cache_dir, args.out)
            return 0
        roots = {"this checkout": ROOT}
        if args.against:
            other = Path(tmp) / "against"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(other),
                 args.against],
                check=True,
            )  # fmt: skip
            roots[args.against] = other
        try:
            results = {
                (name, n): run(root, n, cache_dir, Path(tmp) / f"{i}-{n}.json")
                for i, (name, root) in enumerate(roots.items())
                for n in args.datums
            }
            for (name, n), r in results.items():
                print(
                    f"{name:>14}: {n:3d} datums: peak +{r['peak_mib']:7.1f} MiB "
                    f"({r['peak_mib'] / results[name, args.datums[0]]['peak_mib']:.2f}x "
                    f"{args.datums[0]}), {r['seconds']:6.2f} s, loss {r['loss']:.6f}, "
                    f"adapter {r['adapter_mib']:.1f} MiB"
                )
            if args.against:
                for n in args.datums:
                    mine = np.load(Path(tmp) / f"0-{n}.npz")
                    theirs = np.load(Path(tmp) / f"1-{n}.npz")
                    grad = max(float(np.abs(mine[k] - theirs[k]).max()) for k in mine.files)
                    scale = max(float(np.abs(theirs[k]).max()) for k in theirs.files)
                    loss = abs(
                        results["this checkout", n]["loss"] - results[args.against, n]["loss"]
                    )
                    print(
                        f"{n:3d} datums against {args.against}: largest gradient difference "
                        f"{grad:.3g} (largest gradient {scale:.3g}), loss difference {loss:.3g}"
                    )
        finally:
            if args.against:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "against")],
                    check=False,
                )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
