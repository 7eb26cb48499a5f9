"""Bytes a bfloat16 training pass keeps for its backward per token: the LoRA in float32 (the
engine before) against the LoRA in the activation dtype (the engine now, float32 masters).

Random models of real shapes in bfloat16 on the CPU, frozen, wrapped by the engine's
`LoraHost`: SmolLM2-135M's (30 layers, hidden 576) whole, and Llama-3.1-8B's layers (hidden
4,096, intermediate 14,336, 8 KV heads; `--layers` of its 32, a small vocabulary: the decoder
layers alone are measured, and scaled to 32). An adapter of rank `--rank` on every attention and
MLP linear; the decoder runs forward with grads on (its embeddings taking grads, as earlier
layers' LoRA makes them in a pass) over `--tokens` and twice as many tokens, and the storages
autograd saves are counted (`activation_cost.saved_bytes`: each once, weights left out); the
difference over the difference in tokens is the cost per token. Three ways:
- `bare`: no adapter (what the base model's own backward keeps);
- `fp32 lora`: the adapter's float32 master weights active, as the engine ran before (each
  adapted linear casts its input to float32 and keeps that copy);
- `bf16 lora`: the adapter's bfloat16 copy (`LoraWeights.in_dtype`), as the engine runs now.
Also prints `activation_cost.token_cost` (the probe the checkpointing threshold reads). Byte
counts do not vary run to run. Record the output in docs/benchmarks.md.

Usage: python benchmarks/lora_dtype_memory.py [--tokens 256] [--rank 32] [--layers 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from treadle.engine.lora.adapters import LoraHost, LoraSpec, LoraWeights  # noqa: E402
from treadle.engine.losses.activation_cost import saved_bytes, token_cost  # noqa: E402

BF16 = torch.bfloat16


def _smollm2() -> tuple[LlamaConfig, int]:
    config = LlamaConfig(
        vocab_size=49_152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    return config, 30


def _llama_8b(layers: int) -> tuple[LlamaConfig, int]:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=4096,
        intermediate_size=14_336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    return config, 32


def _per_token(model: LlamaForCausalLM, host: LoraHost, adapter: LoraWeights | None, t: int) -> int:
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if adapter is not None:
        skip |= {p.untyped_storage().data_ptr() for p in adapter.parameters()}

    def bytes_at(tokens: int) -> int:
        ids_B_T = (torch.arange(tokens) % model.config.vocab_size)[None]

        def run() -> torch.Tensor:
            with torch.no_grad():
                embeds_B_T_H = model.get_input_embeddings()(ids_B_T)
            embeds_B_T_H.requires_grad_(True)
            with host.use(adapter):
                return model.get_decoder()(inputs_embeds=embeds_B_T_H).last_hidden_state

        with torch.enable_grad():
            return saved_bytes(run, skip)

    return (bytes_at(2 * t) - bytes_at(t)) // t


def measure(name: str, config: LlamaConfig, full_layers: int, tokens: int, rank: int) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(BF16).requires_grad_(False).eval()
    host = LoraHost(model)
    spec = LoraSpec(rank=rank, alpha=2.0 * rank, seed=0, train_unembed=False)
    masters = host.new_weights(spec, torch.device("cpu"))  # float32
    scale = full_layers / config.num_hidden_layers
    rows = {
        "bare": _per_token(model, host, None, tokens),
        "fp32 lora": _per_token(model, host, masters, tokens),
        "bf16 lora": _per_token(model, host, masters.in_dtype(BF16), tokens),
    }
    print(f"{name}: {config.num_hidden_layers} layers measured, x{scale:g} to {full_layers}")
    for way, per_token in rows.items():
        lora = per_token - rows["bare"]
        print(
            f"  {way:10s} {per_token * scale / 1e6:8.3f} MB/token  "
            f"(the adapter's share {lora * scale / 1e6:6.3f} MB)"
        )
    print(
        f"  saved by bf16: {(rows['fp32 lora'] - rows['bf16 lora']) * scale / 1e6:.3f} MB/token; "
        f"token_cost probe (rank 1): {token_cost(model).layers * scale / 1e6:.3f} MB/token"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2, help="of Llama-3.1-8B's 32")
    args = parser.parse_args()
    torch.set_num_threads(2)
    config, full = _smollm2()
    measure("SmolLM2-135M shape, bf16", config, full, args.tokens, args.rank)
    config, full = _llama_8b(args.layers)
    measure("Llama-3.1-8B shape, bf16", config, full, args.tokens, args.rank)


if __name__ == "__main__":
    main()
