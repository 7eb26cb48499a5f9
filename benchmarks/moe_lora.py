"""LoRA on MoE experts: Treadle's per-routed-token experts (`lora.experts.LoraExperts`) against
peft 0.21's `target_parameters` (its `ParamWrapper` adds every expert's delta to the whole weight
stack, then the model's own experts run on it), and Treadle with attention LoRA alone (the
experts run by the model's own implementation: what the experts' LoRA adds).

A Qwen3-MoE with random weights (`--experts` experts, top `--top-k`, hidden 512, expert width 256,
2 layers, vocabulary 1024), LoRA rank 8 on attention and every expert (B random), one
cross-entropy forward and backward over `--tokens` tokens, in float32 on the CPU. Reports the
median seconds of `--repeats` passes and the bytes autograd saves for the backward (every tensor
`saved_tensors_hooks` sees, counted once per storage), and the largest difference of Treadle's
loss and LoRA grads from peft's; record them in docs/benchmarks.md.

Usage: python benchmarks/moe_lora.py [--experts 32] [--top-k 4] [--tokens 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402

from treadle.engine.lora.adapters import LoraHost, LoraSpec, LoraWeights  # noqa: E402
from treadle.engine.losses.activation_cost import saved_bytes  # noqa: E402


def build(experts: int, top_k: int) -> torch.nn.Module:
    config = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval().requires_grad_(False)


def saved_by(step: Callable[[], torch.Tensor], models: list[torch.nn.Module]) -> int:
    """The bytes autograd saves for the backward of one pass of `step`, beyond the models'
    own parameters (base weights and LoRA tensors, which exist anyway:
    `activation_cost.saved_bytes`); the pass's backward then runs, as every timed one does."""
    own = {p.untyped_storage().data_ptr() for m in models for p in m.parameters()}
    losses: list[torch.Tensor] = []

    def run() -> torch.Tensor:
        losses.append(step())  # kept past the count, for the backward
        return losses[-1]

    saved = saved_bytes(run, own)
    losses[0].backward()
    return saved


def timed(step: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    loss = step()
    loss.backward()
    return time.perf_counter() - start, loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    ids = torch.randint(0, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(1))

    def loss_of(model: torch.nn.Module) -> Callable[[], torch.Tensor]:
        return lambda: model(input_ids=ids, labels=ids, use_cache=False).loss  # type: ignore[no-any-return]

    model = build(args.experts, args.top_k)
    host = LoraHost(model)
    spec = LoraSpec(rank=8, alpha=16.0, train_unembed=False)
    weights = host.new_weights(spec, torch.device("cpu"))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        for b in weights.B.values():
            b.copy_(torch.randn(b.shape, generator=generator) * 0.05)
    config = LoraConfig(
        r=8, lora_alpha=16.0, lora_dropout=0.0,
        target_modules=list(host.targets.suffixes(spec)),
        target_parameters=list(host.targets.parameter_suffixes(spec)),
    )  # fmt: skip
    twin = get_peft_model(build(args.experts, args.top_k), config)
    theirs = {n.replace(".default.", "."): p for n, p in twin.named_parameters() if ".lora_" in n}
    with torch.no_grad():
        for name, tensor in weights.tensors():
            theirs[name].copy_(tensor)

    attention_only = host.new_weights(
        dataclasses.replace(spec, train_mlp=False), torch.device("cpu")
    )
    lora_tensors = [t for _, t in weights.tensors()] + [t for _, t in attention_only.tensors()]
    holder = torch.nn.ParameterList(lora_tensors)
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "attention LoRA only": lambda: _under(host, attention_only, loss_of(model)),
        "Treadle expert LoRA": lambda: _under(host, weights, loss_of(model)),
        "peft target_parameters": loss_of(twin),
    }
    saved = {n: saved_by(v, [model, twin, holder]) for n, v in variants.items()}
    seconds: dict[str, list[float]] = {n: [] for n in variants}
    losses: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):  # interleaved, so a busy machine slows each alike
        for name, step in variants.items():
            took, losses[name] = timed(step)
            seconds[name].append(took)
    # both accumulated their grads over the same passes (1 + repeats) of the same loss
    grad_diff = max(
        (t.grad - theirs[n].grad).abs().max().item()  # type: ignore[operator]
        for n, t in weights.tensors()
    )
    mib = 2**20
    print(f"experts {args.experts}, top-{args.top_k}, {args.tokens} tokens, LoRA rank 8")
    for name in variants:
        median = statistics.median(seconds[name])
        print(f"{name:24s} {median:6.3f} s, saved for backward {saved[name] / mib:6.1f} MiB")
    ours, peft = losses["Treadle expert LoRA"], losses["peft target_parameters"]
    print(f"loss difference {abs(ours - peft).item():.2e}, grads {grad_diff:.2e}")


def _under(host: LoraHost, weights: LoraWeights, step: Callable[[], torch.Tensor]) -> torch.Tensor:
    with host.use(weights):
        return step()


if __name__ == "__main__":
    main()
