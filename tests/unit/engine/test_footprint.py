"""A base model's footprint for admission (treadle/engine/footprint.py) against the real
thing: the LoRA parameters it counts per rank and category are those of a real adapter on the
real model, every one of them holds 16 bytes once trained (fp32 weights, grads, AdamW's two
moments), its KV bytes per token are those of a real cache, and its pass and weight terms follow
the documented formula; a worker's capacity refuses a model by it, with the numbers, and judges
one as before until its footprint is computed. (The platform's sums:
tests/unit/platform/test_admission.py.)"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import torch

from tests import architectures
from treadle.engine.footprint import LOGITS_TENSORS, PassSettings, model_footprint
from treadle.engine.lora.adapters import LoraHost, LoraSpec, TrainableLora
from treadle.engine.losses.activation_cost import ACTIVATION_VALUES_PER_HIDDEN
from treadle.engine.memory.capacity import Capacity
from treadle.engine.models.loading import tiny_debug_config
from treadle.engine.optim import AdamSpec
from treadle.platform.config import DEFAULT_SAMPLER_KV_TOKENS, PlatformConfig
from treadle.platform.models.catalog import TINY_DEBUG_NAME, BaseModelInfo, get_base_model
from treadle.platform.sessions.admission import BYTES_PER_LORA_PARAMETER, lora_parameters

CPU = PassSettings(torch.device("cpu"), torch.float32, sampler_kv_tokens=1000, device_bytes=2**40)
FLAGS = [
    dict(zip(("train_attn", "train_mlp", "train_unembed"), f, strict=True))
    for f in itertools.product([True, False], repeat=3)
    if any(f)
]


def _registered(arch: str, folder: Path) -> tuple[BaseModelInfo, torch.nn.Module]:
    cfg = architectures.config(arch)
    cfg.save_pretrained(str(folder))
    model = architectures.build(arch, cfg=cfg)
    info = BaseModelInfo(
        name=f"t/{arch}", kind="hf", max_context_length=512, tokenizer_source="x",
        vocab_size=cfg.vocab_size, description="", path=str(folder),
        parameters=sum(p.numel() for p in model.parameters()),
    )  # fmt: skip
    return info, model


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "phi3", "gemma3", "qwen3-moe", "gpt-oss"])
def test_lora_parameters_per_rank_are_a_real_adapters(arch: str, tmp_path: Path) -> None:
    info, model = _registered(arch, tmp_path)
    fp = model_footprint(info, CPU, tmp_path)
    host = LoraHost(model)
    for flags, rank in zip(FLAGS, itertools.cycle([1, 4, 8]), strict=False):
        lora = {"rank": rank, **flags}
        weights = host.new_weights(LoraSpec(rank=rank, alpha=8.0, **flags), torch.device("cpu"))
        real = sum(t.numel() for t in weights.parameters())
        assert lora_parameters(fp.as_dict(), lora) == real, (arch, lora)


def test_a_trained_adapter_holds_16_bytes_per_parameter(tmp_path: Path) -> None:
    info, model = _registered("qwen3", tmp_path)
    host = LoraHost(model)
    lora = TrainableLora(host.new_weights(LoraSpec(rank=4, alpha=8.0), torch.device("cpu")))
    tokens = torch.tensor([[1, 2, 3, 4]])
    for _ in range(2):  # a step (Adam's moments), then grads pending again
        with host.use(lora.weights):
            model(input_ids=tokens).logits.float().logsumexp(-1).sum().backward()
        if not lora.optimizer.state:
            lora.step(AdamSpec())
    held = lora.state_tensors()
    big = sum(t.nbytes for t in held.values() if t.numel() > 1)
    assert big == BYTES_PER_LORA_PARAMETER * lora.numel()
    # the rest: AdamW's step counters, one scalar per tensor
    assert len([t for t in held.values() if t.numel() <= 1]) == len(lora.weights.parameters())


def test_kv_bytes_are_a_real_caches_per_token() -> None:
    info = get_base_model(TINY_DEBUG_NAME)
    fp = model_footprint(info, CPU, Path("."))
    config = tiny_debug_config(256)
    model = __import__("transformers").LlamaForCausalLM(config).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.arange(10)[None], use_cache=True).past_key_values
    real = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert fp.kv_bytes == real // 10 * CPU.sampler_kv_tokens


def test_the_pass_and_weight_terms_follow_the_documented_formula() -> None:
    info = get_base_model(TINY_DEBUG_NAME)  # hidden 64, 2 layers, 49,152 tokens, 2,048 context
    fp = model_footprint(info, CPU, Path("."))
    assert fp.pass_tokens == 2048  # one datum of the whole context runs alone
    assert not fp.checkpointed  # 2,048 x 20 x 64 x 2 x 4 bytes is far under a quarter of 1 TiB
    # per token and layer: 20 hidden-sized values, and the float32 inputs of its linears the
    # adapter may target (q, k, v, o, gate, up: 64 each; down: 128), losses.passes.token_bytes
    lora_inputs = (6 * 64 + 128) * 4
    activations = 2048 * 2 * (ACTIVATION_VALUES_PER_HIDDEN * 64 * 4 + lora_inputs)
    logits = LOGITS_TENSORS * 4 * min(2048 * 49152, 2**27)
    assert fp.pass_bytes == activations + logits
    unpacked = model_footprint(
        info, PassSettings(**{**CPU.__dict__, "pack_cpu_weights": False}), Path(".")
    )
    assert unpacked.weight_bytes == 4 * info.parameters
    sharded = model_footprint(
        info, PassSettings(**{**CPU.__dict__, "pack_cpu_weights": False, "shards": 2}), Path(".")
    )
    # a rank's peak (footprint._held): half of each of the 2 decoder layers, the tied embedding
    # whole (distributed.vocabulary), and 2 layers gathered (the one running, FSDP's next)
    with torch.device("meta"):
        meta = __import__("transformers").LlamaForCausalLM(tiny_debug_config(49152))
    layer = sum(p.numel() for p in meta.model.layers[0].parameters())
    rest = info.parameters - 2 * layer
    assert sharded.weight_bytes == 4 * (layer + rest + 2 * layer)
    # float32 passes run on the adapter's masters; bfloat16 ones on a copy, 2 bytes a parameter
    assert fp.adapter_copy_bytes == 0
    bf16 = model_footprint(
        info, PassSettings(**{**CPU.__dict__, "dtype": torch.bfloat16}), Path(".")
    )
    assert bf16.adapter_copy_bytes == 2
    checkpointed = model_footprint(
        info, PassSettings(**{**CPU.__dict__, "checkpointing": True}), Path(".")
    )
    assert (
        checkpointed.pass_bytes
        == 2048 * ((64 * 2 + ACTIVATION_VALUES_PER_HIDDEN * 64) * 4 + lora_inputs) + logits
    )


def test_a_worker_refuses_a_model_whose_fixed_footprint_exceeds_its_budget_with_the_numbers() -> (
    None
):
    info = get_base_model(TINY_DEBUG_NAME)
    fp = model_footprint(info, CPU, Path(".")).as_dict()
    fixed = fp["weight_bytes"] + fp["pass_bytes"] + fp["kv_bytes"]
    cpu = torch.device("cpu")
    roomy = Capacity(cpu, torch.float32, fixed, measure=lambda _: fp, sampler_kv_tokens=1000)
    tight = Capacity(cpu, torch.float32, fixed - 1, measure=lambda _: fp, sampler_kv_tokens=1000)
    for capacity in (roomy, tight):
        capacity.wait([info], timeout=60)
    assert roomy.refusal(info) is None
    why = tight.refusal(info)
    assert why is not None and "before any session" in why and "3,219,776 parameters" in why
    assert f"a training pass of {fp['pass_tokens']:,} tokens" in why
    assert "the sampler's KV budget of 1,000 tokens" in why
    report = roomy.report([info])
    assert report["footprints"] == {info.name: fp}
    assert report["budget"]["capacity_bytes"] == fixed


def test_a_gpu_worker_refuses_a_model_its_host_cannot_load() -> None:
    info = get_base_model(TINY_DEBUG_NAME)
    fp = {"weight_bytes": 1, "pass_bytes": 1, "kv_bytes": 1, "pass_tokens": 1,
          "load_host_bytes": 2**30}  # fmt: skip
    capacity = Capacity(
        torch.device("cpu"), torch.float32, 2**20, measure=lambda _: fp, host_memory_bytes=2**29
    )
    capacity.wait([info], timeout=60)
    why = capacity.refusal(info)
    assert why is not None and "loading it takes 1.00 GiB of host memory" in why
    assert "this host has 0.50 GiB (TREADLE_WORKER_HOST_MEMORY)" in why


def test_until_its_footprint_is_computed_a_model_is_judged_by_its_weights_and_a_tenth() -> None:
    info = get_base_model(TINY_DEBUG_NAME)
    gate = threading.Event()

    def slow(_: BaseModelInfo) -> dict[str, int]:
        gate.wait(60)
        return {"weight_bytes": 2**40, "pass_bytes": 0, "kv_bytes": 0, "pass_tokens": 1,
                "load_host_bytes": 0}  # fmt: skip

    capacity = Capacity(torch.device("cpu"), torch.float32, 2**30, measure=slow)
    assert capacity.refusal(info) is None  # 13.5 MiB of weights and a tenth fit 1 GiB
    assert capacity.report([info])["footprints"] == {}
    gate.set()
    capacity.wait([info], timeout=60)
    assert capacity.refusal(info) is not None  # now judged by its (made-up, huge) footprint


def test_the_new_settings_come_from_the_environment_and_go_back_to_it() -> None:
    env = {"TREADLE_SAMPLER_KV_TOKENS": "1024", "TREADLE_WORKER_HOST_MEMORY": "5"}
    config = PlatformConfig.from_env(env)
    assert (config.sampler_kv_tokens, config.worker_host_memory_bytes) == (1024, 5)
    assert PlatformConfig.from_env(config.to_env()) == config
    assert PlatformConfig.from_env({}).sampler_kv_tokens == DEFAULT_SAMPLER_KV_TOKENS
