"""Peak memory of the reference sampler under its KV budget: 16 concurrent requests x 8 samples
on SmolLM2-135M (`engine.sample_batch`, the decode loop the worker drives), each a prompt of
`--prompt-tokens` distinct tokens and `--new-tokens` sampled (temperature 1, no early stop).

Cases: each `--budgets` value as the engine's `sampler_kv_tokens` (TREADLE_SAMPLER_KV_TOKENS;
requests beyond it wait for room and join when others finish), and with `--against REV` the same
call on another commit's engine (its files extracted with `git archive`, run with this checkout's
environment), e.g. the one before the budget, whose cache grew by a copy per token and held each
prompt once per sample. Each case runs in a fresh process after a warm-up call: the peak is VmHWM,
reset just before the call, minus VmRSS then. Prints the peak, the KV bytes the budget allows
(2 x layers x kv heads x head dim x 4 bytes per token), seconds, and whether every case's tokens
equal the first case's.

    python benchmarks/sampling_kv.py [--budgets 2048 9088] [--against c1a955f]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
REQUESTS, SAMPLES = 16, 8


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def child(budget: int, prompt_tokens: int, new_tokens: int, cache_dir: Path, out: Path) -> None:
    """One `sample_batch` of the 16 requests after a warm-up; writes its peak and tokens."""
    from treadle.engine import Engine, SampleRequest, SampleResult, SamplingSpec
    from treadle.platform.models.catalog import SMOLLM2_NAME

    kwargs = {"sampler_kv_tokens": budget} if budget else {}  # 0: an engine without a budget
    if budget:
        assert "sampler_kv_tokens" in inspect.signature(Engine).parameters
    engine = Engine(cache_dir=cache_dir, device="cpu", **kwargs)
    spec = SamplingSpec(max_tokens=new_tokens, temperature=1.0, stop=())
    requests = [
        SampleRequest(
            SMOLLM2_NAME,
            None,
            [(97 * i + 31 * j) % 5000 + 100 for j in range(prompt_tokens)],
            SAMPLES,
            SamplingSpec(max_tokens=spec.max_tokens, temperature=1.0, seed=i, stop=()),
        )
        for i in range(REQUESTS)
    ]
    engine.sample_batch([SampleRequest(SMOLLM2_NAME, None, [100, 200], 1, spec)])  # warm-up
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    results = engine.sample_batch(requests)
    seconds = time.perf_counter() - started
    peak = (_status_kib("VmHWM") - before) * 1024
    tokens = []
    for result in results:
        assert isinstance(result, SampleResult), result
        tokens.append([s.tokens for s in result.sequences])
    out.write_text(json.dumps({"peak_mib": peak / MIB, "seconds": seconds, "tokens": tokens}))


def run(root: Path, budget: int, args: argparse.Namespace, out: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(root)}  # `treadle` imported from `root`
    command = [sys.executable, __file__, "--child", str(budget), "--out", str(out)]
    command += ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    command += ["--cache-dir", str(args.cache_dir)]
    subprocess.run(command, env=env, check=True, cwd=root)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def kv_bytes_per_token(cache_dir: Path) -> int:
    """SmolLM2's KV bytes per token in float32 (`engine.footprint`'s formula)."""
    from treadle.engine.footprint import _config
    from treadle.platform.models.catalog import SMOLLM2_NAME, get_base_model

    text = _config(get_base_model(SMOLLM2_NAME), cache_dir).get_text_config()
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * int(text.num_hidden_layers) * int(text.num_key_value_heads) * head_dim * 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 9088])
    parser.add_argument("--against", default=None, help="a commit to compare with")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.prompt_tokens, args.new_tokens, args.cache_dir, args.out)
        return 0
    from treadle.engine import kv_need
    from treadle.platform.config import DEFAULT_CACHE_DIR

    args.cache_dir = args.cache_dir or DEFAULT_CACHE_DIR
    per_token = kv_bytes_per_token(args.cache_dir)
    need = kv_need(args.prompt_tokens, SAMPLES, args.new_tokens)
    print(
        f"{REQUESTS} requests x {SAMPLES} samples, prompts of {args.prompt_tokens}, "
        f"{args.new_tokens} new tokens; KV {per_token:,} bytes a token, {need:,} tokens a request"
    )
    with tempfile.TemporaryDirectory() as tmp:
        cases: list[tuple[str, Path, int]] = [
            (f"budget {b:,} tokens", ROOT, b) for b in args.budgets
        ]
        if args.against:
            other = Path(tmp) / "against"
            other.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.against],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(other)], input=archive, check=True)
            cases.append((f"{args.against} (no budget)", other, 0))
        first: object = None
        for i, (name, root, budget) in enumerate(cases):
            r = run(root, budget, args, Path(tmp) / f"{i}.json")
            first = r["tokens"] if first is None else first
            allowed = (
                f"budget allows {budget * per_token / MIB:6.1f} MiB, "
                f"{budget // need} requests at once"
                if budget
                else "no budget"
            )
            print(
                f"{name:>28}: peak +{r['peak_mib']:7.1f} MiB ({allowed}), "
                f"{r['seconds']:6.1f} s, tokens {'equal' if r['tokens'] == first else 'DIFFER'}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
