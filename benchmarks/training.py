"""Training throughput: `forward_backward` on a batch of SmolLM2-135M-Instruct through the SDK,
against the same forward and backward in plain transformers + peft in this process.

The baseline (`peft_baseline.Baseline`): one peft adapter of the same rank and targets, float32,
the same `--batch` x `--tokens` token ids, a forward, the cross-entropy summed over every token and
its backward, loaded once in this process. The platform (`treadle up`, one worker) gets the same
batch through Treadle's SDK: `forward_backward(..., "cross_entropy")` on one session, waited for.
After a warm-up of each, `--trials` rounds alternate the two (which goes first alternating too),
so the machine's drifting load falls on both alike. Prints the median seconds of each, their
ratio, and the worker's and this process's peak memory over the timed rounds; record them in
docs/benchmarks.md.

Usage: python benchmarks/training.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--trials 7]
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

import torch  # noqa: E402
from peft_baseline import Baseline, batch, memory, reset_peak, worker_pid  # noqa: E402

import treadle  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.platform.models.catalog import SMOLLM2_NAME  # noqa: E402
from treadle.recipes.platform_process import LocalPlatform  # noqa: E402

MB = 1024 * 1024


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=SMOLLM2_NAME)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args()
    seqs = batch(args.batch, args.tokens)
    data = [
        treadle.Datum(
            model_input=treadle.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in seqs
    ]
    baseline = Baseline(args.model, seqs, args.rank)  # its constructor takes a warm-up step
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-training-bench-"))
    key = "tml-bench-" + secrets.token_hex(8)
    treadle_s, peft_s = [], []
    try:
        with LocalPlatform(data_dir, free_port(), key, workers=1) as platform:
            svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
            tc = svc.create_lora_training_client(args.model, rank=args.rank, alpha=32)

            def through_treadle() -> float:
                started = time.perf_counter()
                tc.forward_backward(data, "cross_entropy").result()
                return time.perf_counter() - started

            through_treadle()  # warm-up: the worker loads the model, the adapter is created
            pid = worker_pid(platform)
            reset_peak(pid)
            Path("/proc/self/clear_refs").write_text("5")
            for trial in range(args.trials):
                if trial % 2 == 0:
                    treadle_s.append(through_treadle())
                    peft_s.append(baseline.forward_backward())
                else:
                    peft_s.append(baseline.forward_backward())
                    treadle_s.append(through_treadle())
            worker_peak = memory(pid)["VmHWM"]
            own_peak = memory(int(Path("/proc/self/stat").read_text().split()[0]))["VmHWM"]
            svc.close()
    except BaseException:
        print(f"the run failed; the platform's logs are under {data_dir}", file=sys.stderr)
        raise
    shutil.rmtree(data_dir, ignore_errors=True)
    t, p = statistics.median(treadle_s), statistics.median(peft_s)
    print(
        f"forward_backward, {args.model}, {args.batch} x {args.tokens} tokens, LoRA rank "
        f"{args.rank} on every linear, cross-entropy; {torch.get_num_threads()} torch threads; "
        f"median of {args.trials} alternating trials:"
    )
    print(f"  in-process peft:          {p:7.2f} s   {[round(x, 2) for x in peft_s]}")
    print(f"  through Treadle's SDK:    {t:7.2f} s   {[round(x, 2) for x in treadle_s]}")
    print(f"  Treadle / peft:           {t / p:7.2f}x")
    print(f"  peak memory: worker {worker_peak / MB:.0f} MiB, this process (peft) "
          f"{own_peak / MB:.0f} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
