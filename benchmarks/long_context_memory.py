"""Peak memory of one long sequence's forward_backward: full logits against chunked + checkpointed.

One sequence of `--tokens` tokens (cross-entropy) through a Qwen3 with a real vocabulary
(`--vocab`, Qwen3's 151,936) and a tiny hidden size (64, 2 layers, random weights), so the
logits, not the model, are what the memory holds; LoRA rank 8 on attention and the unembedding,
B random so every grad is nonzero. The pass is the engine's (`validate_data`, `microbatches`,
`batch_loss` with the adapter active, `backward`), in three ways:
- `before`: the model's own forward, full float32 [T, V] logits, no checkpointing (the path
  before `chunked_logprobs`);
- `chunked`: logits in chunks of `MICROBATCH_LOGITS` (what the engine runs here by default:
  this model's activations are too small for its default to checkpoint);
- `after`: chunked and every decoder layer checkpointed.
Each runs in a fresh subprocess; the peak is VmHWM (reset just before the pass) minus VmRSS then,
on CUDA `torch.cuda.max_memory_allocated` less the allocation before. Prints the peaks, their
ratio to `before`, the seconds, and the largest difference of the grads from `before`'s; record
them in docs/benchmarks.md.

Usage: python benchmarks/long_context_memory.py [--tokens 8192] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

from treadle.engine.lora.adapters import LoraHost, LoraSpec  # noqa: E402
from treadle.engine.losses.functions import (  # noqa: E402
    MICROBATCH_LOGITS,
    EngineDatum,
    batch_loss,
    get_loss,
    microbatches,
    validate_data,
)

MIB = 2**20
WAYS = {  # name -> (logits_per_chunk, checkpoint_layers)
    "before": (None, False),
    "chunked": (MICROBATCH_LOGITS, None),
    "after": (MICROBATCH_LOGITS, True),
}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def measure(way: str, tokens: int, vocab: int, grads_file: Path) -> dict[str, float]:
    """One forward_backward `way`, in this process: its peak memory above the resident memory
    before it (bytes), its seconds; the adapter's grads saved to `grads_file`."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max(tokens, 512),
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    host = LoraHost(model)
    weights = host.new_weights(LoraSpec(rank=8, alpha=16, train_mlp=False), device)
    with torch.no_grad():
        for b in weights.B.values():
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)) * 0.01)
    rng = np.random.default_rng(2)
    sequence = rng.integers(0, vocab, tokens + 1)
    datum = EngineDatum(
        tokens=tuple(int(t) for t in sequence[:-1]),
        loss_fn_inputs={
            "target_tokens": sequence[1:],
            "weights": np.ones(tokens, np.float32),
        },
    )
    loss = get_loss("cross_entropy")
    arrays = validate_data([datum], loss, vocab_size=vocab, max_context_length=tokens)
    logits_per_chunk, checkpoint_layers = WAYS[way]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = _status_kib("VmRSS") * 1024
    started = time.perf_counter()
    with host.use(weights):
        for group in microbatches(arrays, 1):  # one datum: one pass, whatever the budget
            _, total = batch_loss(
                model,
                group,
                loss,
                {},
                logits_per_chunk=logits_per_chunk,
                checkpoint_layers=checkpoint_layers,
            )
            total.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kib("VmHWM") * 1024
    seconds = time.perf_counter() - started
    grads = {name: t.grad for name, t in weights.tensors()}
    torch.save({name: g.float().cpu() for name, g in grads.items() if g is not None}, grads_file)
    return {"peak_bytes": peak - before, "seconds": seconds, "loss": float(total)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of " + str(WAYS))
    parser.add_argument("--measure", choices=list(WAYS), help=argparse.SUPPRESS)
    parser.add_argument("--grads", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the child: one way, its numbers as one JSON line
        print(json.dumps(measure(args.measure, args.tokens, args.vocab, args.grads)))
        return 0

    ways = args.ways.split(",")
    results: dict[str, dict[str, float]] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in ways:
            grads_file = Path(tmp) / f"{way}.pt"
            child = subprocess.run(
                [sys.executable, __file__, "--measure", way, "--grads", str(grads_file),
                 "--tokens", str(args.tokens), "--vocab", str(args.vocab)],
                capture_output=True, text=True,
            )  # fmt: skip
            if child.returncode != 0:
                print(f"{way}: failed (exit {child.returncode})\n{child.stderr[-2000:]}")
                continue
            results[way] = json.loads(child.stdout.strip().splitlines()[-1])
            grads[way] = torch.load(grads_file)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"one sequence of {args.tokens} tokens, vocabulary {args.vocab}, on {device}")
    print("  way       peak above start   vs before   seconds   loss            grads vs before")
    reference = grads.get("before")
    for way, r in results.items():
        ratio = r["peak_bytes"] / results["before"]["peak_bytes"] if "before" in results else 0
        diff = "-"
        if reference is not None and way != "before":
            worst = max(float((grads[way][n] - g).abs().max()) for n, g in reference.items())
            largest = max(float(g.abs().max()) for g in reference.values())
            diff = f"max abs diff {worst:.2e} (largest grad {largest:.2e})"
        print(
            f"  {way:8}  {r['peak_bytes'] / MIB:10,.0f} MiB   {ratio:8.3f}x   {r['seconds']:7.1f}"
            f"   {r['loss']:.6e}   {diff}"
        )
    return 0 if len(results) == len(ways) else 1


if __name__ == "__main__":
    raise SystemExit(main())
