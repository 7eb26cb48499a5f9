"""Replay speed: how fast `treadle replay` re-runs a session from its log, verified step by step,
in operations per second and relative to the compute the original run spent on the same steps.

Runs the embedded platform (`treadle up`, one worker) and, through Treadle's SDK, a training
session of `--steps` steps (`forward_backward` of one 32-token datum + `optim_step`); then replays
it `--trials` times through `ServiceClient.replay`. From each report: operations replayed, the
replay's seconds (load nothing, replay, check every state hash) and the original seconds (the
same operations' durations as first logged). Also times a fork at the session's midpoint, from
the request to a live client. Prints medians; record them in docs/benchmarks.md.

Usage: python benchmarks/replay.py [--steps 40] [--trials 5] [--model treadle/tiny-debug]
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import treadle  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.recipes.platform_process import LocalPlatform  # noqa: E402


def batch(step: int) -> list[treadle.Datum]:
    ids = [(5 * step + 3 * i) % 200 + 1 for i in range(33)]
    return [
        treadle.Datum(
            model_input=treadle.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--model", default="treadle/tiny-debug")
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-replay-bench-"))
    key = "tml-bench-" + secrets.token_hex(8)
    rates, ratios, replayed, forks = [], [], 0, []
    try:
        with LocalPlatform(data_dir, free_port(), key, workers=1) as platform:
            svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
            tc = svc.create_lora_training_client(args.model, rank=16, seed=1)
            for i in range(args.steps):
                fb = tc.forward_backward(batch(i), loss_fn="cross_entropy")
                tc.optim_step(treadle.AdamParams(learning_rate=1e-3)).result()
                fb.result()
            for _ in range(args.trials):
                replay = svc.replay(tc.model_id)
                report = replay.report
                assert report.matched, str(report)
                assert report.seconds and report.original_seconds
                replayed = report.replayed
                rates.append(report.replayed / report.seconds)
                ratios.append(report.seconds / report.original_seconds)
                replay.training_client.stop()
                started = time.perf_counter()
                fork = svc.fork_training_client(tc.model_id, at_seq=args.steps)
                forks.append(time.perf_counter() - started)
                fork.stop()
            svc.close()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    print(
        f"replay of a {2 * args.steps + 1}-operation session on {args.model}, {args.trials} "
        f"trials ({replayed} operations replayed and verified each):"
    )
    print(f"  replay speed: median {statistics.median(rates):.1f} operations/s")
    print(f"  replay time / original compute time: median {statistics.median(ratios):.2f}")
    print(
        f"  fork at the midpoint (seq {args.steps}), request -> live client: median "
        f"{statistics.median(forks):.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
