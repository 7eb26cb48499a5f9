"""Sampling throughput: 16 concurrent `sample` requests through the SDK against the worker's
batched decoding, relative to plain transformers `generate` on the same prompts in one batch.

First the in-process baseline: the catalogue's model (the same weights the worker loads), greedy
`generate` of `--new-tokens` tokens for `--requests` prompts of `--prompt-tokens` tokens, as one
left-padded batch. Then the embedded platform (`treadle up`, one worker) and, through Treadle's
SDK, the same prompts as `--requests` concurrent requests (greedy, no early stop): on one
session's sampler, then on `--requests` sessions (each its own adapter), and one at a time for
reference. Each concurrent run's tokens are checked equal to the one-at-a-time run's. Prints
median tokens/s and the ratios; record them in docs/benchmarks.md.

Usage: python benchmarks/sampling.py [--model treadle/tiny-debug] [--trials 3]
"""

from __future__ import annotations

import argparse
import gc
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import treadle  # noqa: E402
from treadle.gpu_worker.models import load_base_model  # noqa: E402
from treadle.platform.config import DEFAULT_CACHE_DIR  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.recipes.platform_process import LocalPlatform  # noqa: E402


def prompts(count: int, length: int) -> list[list[int]]:
    return [[(97 * i + 31 * j) % 5000 + 100 for j in range(length)] for i in range(count)]


def baseline(model_name: str, prompts_B: list[list[int]], new_tokens: int, trials: int) -> float:
    """Median tokens/s of transformers' batched greedy `generate` in this process."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tokenizer = load_base_model(model_name, DEFAULT_CACHE_DIR, device, dtype)
    ids_B_T = torch.tensor(prompts_B, device=device)
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    rates = []
    for trial in range(trials + 1):  # the first is a warm-up
        started = time.perf_counter()
        with torch.inference_mode():
            out_B_T = model.generate(
                input_ids=ids_B_T,
                attention_mask=torch.ones_like(ids_B_T),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        seconds = time.perf_counter() - started
        assert out_B_T.shape[1] == ids_B_T.shape[1] + new_tokens
        if trial:
            rates.append(len(prompts_B) * new_tokens / seconds)
    del model
    gc.collect()
    return statistics.median(rates)


def concurrent(
    samplers: Sequence[Any], prompts_B: list[list[int]], params: Any
) -> tuple[float, list[list[int]]]:
    """(tokens/s, tokens per request) with every request in flight at once."""
    started = time.perf_counter()
    futures = [samplers[i % len(samplers)].sample(p, 1, params) for i, p in enumerate(prompts_B)]
    with ThreadPoolExecutor(len(futures)) as pool:
        results = list(pool.map(lambda f: f.result(), futures))
    seconds = time.perf_counter() - started
    tokens = [list(r.sequences[0].tokens) for r in results]
    return sum(map(len, tokens)) / seconds, tokens


def one_at_a_time(
    samplers: Sequence[Any], prompts_B: list[list[int]], params: Any
) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    results = [
        samplers[i % len(samplers)].sample(p, 1, params).result() for i, p in enumerate(prompts_B)
    ]
    seconds = time.perf_counter() - started
    tokens = [list(r.sequences[0].tokens) for r in results]
    return sum(map(len, tokens)) / seconds, tokens


def median_rate(
    run: Callable[[], tuple[float, list[list[int]]]], trials: int, expected: list[list[int]]
) -> float:
    rates = []
    for _ in range(trials):
        rate, tokens = run()
        assert tokens == expected, "batched sampling changed a request's tokens"
        rates.append(rate)
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="treadle/tiny-debug")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    prompts_B = prompts(args.requests, args.prompt_tokens)
    base_rate = baseline(args.model, prompts_B, args.new_tokens, args.trials)
    params = treadle.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, stop=[])
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-sampling-bench-"))
    key = "tml-bench-" + secrets.token_hex(8)
    try:
        with LocalPlatform(data_dir, free_port(), key, workers=1) as platform:
            svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
            trainers = [
                svc.create_lora_training_client(args.model, rank=16, seed=i)
                for i in range(args.requests)
            ]
            samplers = [tc.save_weights_and_get_sampling_client() for tc in trainers]
            one_at_a_time(samplers[:1], prompts_B[:2], params)  # warm-up
            serial_rate, expected = one_at_a_time(samplers[:1], prompts_B, params)
            one_rate = median_rate(
                lambda: concurrent(samplers[:1], prompts_B, params), args.trials, expected
            )
            many_rate = median_rate(
                lambda: concurrent(samplers, prompts_B, params), args.trials, expected
            )
            svc.close()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    n = args.requests
    print(
        f"{n} requests x {args.prompt_tokens}-token prompts x {args.new_tokens} new tokens on "
        f"{args.model}, greedy, median of {args.trials} trials:"
    )
    print(f"  in-process batched generate:        {base_rate:8.1f} tokens/s")
    print(f"  SDK, one at a time:                 {serial_rate:8.1f} tokens/s "
          f"({serial_rate / base_rate:.2f}x)")  # fmt: skip
    print(f"  SDK, {n} concurrent on 1 session:    {one_rate:8.1f} tokens/s "
          f"({one_rate / base_rate:.2f}x)")  # fmt: skip
    print(f"  SDK, {n} concurrent on {n} sessions: {many_rate:8.1f} tokens/s "
          f"({many_rate / base_rate:.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
