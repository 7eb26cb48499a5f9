"""Many sessions on one worker: its memory and the step time with 1, 4, 16 and 64 sessions
sharing one base model, each session its own LoRA adapter with its own Adam state.

The in-process baseline: plain transformers + peft, one adapter of the same rank and targets,
the same batch, `forward` + cross-entropy `backward` + AdamW `step`, loaded once in this process
and timed one step after each measured Treadle step (the machine's load drifts, so the two
alternate). For each session count, a fresh embedded platform (`treadle up`, one worker, the worker's default
`TREADLE_MAX_LOADED_ADAPTERS` unless `--max-loaded` says otherwise) and, through Treadle's SDK,
that many training clients stepped round robin: each step is one session's `forward_backward`
and `optim_step`, sent together and waited for, one session at a time, so a step that must read
its adapter back from disk pays for it in full. Every session first takes one unmeasured step
(its one-off costs, and Adam state for every adapter), then `--steps` steps are timed, round
robin from the least recently used session. The worker's memory is read from
/proc/<pid>/status: the peak (VmHWM, reset after the first session's first step, so the model's
loading is left out) and the steady RSS once the steps are done. Prints median step times,
memory and the ratios to 1 session; record them in docs/benchmarks.md.

Usage: python benchmarks/sessions.py [--model treadle/tiny-debug] [--sessions 1,4,16,64]
"""

from __future__ import annotations

import argparse
import gc
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from peft_baseline import (  # noqa: E402
    LEARNING_RATE,
    Baseline,
    batch,
    memory,
    reset_peak,
    worker_pid,
)

import treadle  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.platform.models.catalog import SMOLLM2_NAME  # noqa: E402
from treadle.recipes.platform_process import LocalPlatform  # noqa: E402

MB = 1024 * 1024


@dataclass
class Run:
    sessions: int
    steps: int
    step_s: float
    peft_s: float  # the in-process baseline's median step, alternating with Treadle's
    peak: int
    steady: int


def run_sessions(
    args: argparse.Namespace, n: int, seqs: list[list[int]], baseline: Baseline
) -> Run:
    data = [
        treadle.Datum(
            model_input=treadle.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in seqs
    ]
    adam = treadle.AdamParams(learning_rate=LEARNING_RATE)
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-sessions-bench-"))
    key = "tml-bench-" + secrets.token_hex(8)
    try:
        with LocalPlatform(data_dir, free_port(), key, workers=1) as platform:
            svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
            clients: list[Any] = [
                svc.create_lora_training_client(args.model, rank=args.rank, seed=i)
                for i in range(n)
            ]
            pid = worker_pid(platform)

            def step(tc: Any) -> float:
                started = time.perf_counter()
                fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
                fb.result()
                opt.result()
                return time.perf_counter() - started

            step(clients[0])  # warm-up: the first step's one-off costs
            reset_peak(pid)
            for tc in clients[1:]:
                step(tc)
            seconds, peft = [], []
            for i in range(args.steps):
                seconds.append(step(clients[i % n]))
                peft.append(baseline.step())  # while the worker is idle
            time.sleep(1.0)  # let the worker settle (the settlement after the last result)
            mem = memory(pid)
            svc.close()
    except BaseException:
        print(f"{n} sessions failed; the platform's logs are under {data_dir}", file=sys.stderr)
        raise
    shutil.rmtree(data_dir, ignore_errors=True)
    return Run(
        n, len(seconds), statistics.median(seconds), statistics.median(peft), mem["VmHWM"],
        mem["VmRSS"],
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=SMOLLM2_NAME)
    parser.add_argument("--sessions", default="1,4,16,64")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--steps", type=int, default=12,
        help="measured steps per session count, round robin over its sessions",
    )  # fmt: skip
    parser.add_argument(
        "--max-loaded", type=int, default=None,
        help="TREADLE_MAX_LOADED_ADAPTERS for the worker (default: the worker's own; 0: none)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.max_loaded is not None:
        os.environ["TREADLE_MAX_LOADED_ADAPTERS"] = str(args.max_loaded)
    limit = os.environ.get("TREADLE_MAX_LOADED_ADAPTERS", "the default")
    counts = [int(n) for n in args.sessions.split(",")]
    seqs = batch(args.batch, args.tokens)
    started = time.perf_counter()
    baseline = Baseline(args.model, seqs, args.rank)
    runs = [run_sessions(args, n, seqs, baseline) for n in counts]
    total = time.perf_counter() - started
    del baseline
    gc.collect()
    one = runs[0]
    print(
        f"{args.model}, LoRA rank {args.rank}, {args.batch} x {args.tokens} tokens per step "
        f"(forward_backward + optim_step), TREADLE_MAX_LOADED_ADAPTERS={limit}, "
        f"{os.cpu_count()} CPUs ({torch.get_num_threads()} torch threads), "
        f"whole run {total:.0f} s"
    )
    print("  sessions  steps  median step (x 1 session)  in-process peft (Treadle / peft)"
          "   worker peak RSS (x 1)   steady RSS (x 1)")  # fmt: skip
    for r in runs:
        print(
            f"  {r.sessions:8d}  {r.steps:5d}  {r.step_s * 1000:7.0f} ms ({r.step_s / one.step_s:4.2f}x)"
            f"      {r.peft_s * 1000:7.0f} ms ({r.step_s / r.peft_s:4.2f}x)"
            f"        {r.peak / MB:7.0f} MiB ({r.peak / one.peak:4.2f}x)"
            f"   {r.steady / MB:7.0f} MiB ({r.steady / one.steady:4.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
