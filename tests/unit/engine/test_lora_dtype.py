"""LoRA in the activation dtype: an engine running a tiny random model in bfloat16 (on the CPU,
as CUDA runs models by default) computes the adapter in bfloat16 from float32 master weights, grads
and Adam state. Its loss and LoRA grads equal peft's computing in bfloat16 bit for bit (peft's
adapter weights bfloat16 with the same values, `autocast_adapter_dtype=False`), on every dense
architecture of tests/architectures.py; the backward keeps no float32 copies of activations for
the LoRA; a step updates the float32 masters and the bfloat16 copy the next pass runs; an adapter
paged out to disk and back trains on as one never paged; sampling
with snapshots runs the same copies. (MoE experts are left out of the exact comparison: peft
adds each expert's delta to the bfloat16 weight stack before the product, a different rounding
from Treadle's per-expert delta: tests/unit/engine/test_lora_architectures.py compares them in
float32.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from tests import tiny_models
from tests.architectures import ARCHITECTURES, MOE, build
from treadle.engine import AdamSpec, Engine, EngineDatum, LoraSpec, SamplingSpec
from treadle.engine.lora.adapters import LoraHost, LoraWeights, compute_dtype
from treadle.engine.lora.targets import resolve
from treadle.engine.losses.functions import batch_loss, get_loss, validate_data
from treadle.engine.models.loading import load_base_model
from treadle.engine.sampling.decode import SampleRequest
from treadle.platform.models import model_files
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.models.losses import resolve_config

pytestmark = [
    pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

BF16 = torch.bfloat16
DENSE = sorted(a for a in ARCHITECTURES if a not in MOE)
SPEC = LoraSpec(rank=4, alpha=8.0, seed=1)
CROSS_ENTROPY = get_loss("cross_entropy")
# Two rows of different lengths (padding), longer than the 16-token sliding windows.
TOKENS = ([(7 * i + 3) % 256 for i in range(21)], [(11 * i + 5) % 256 for i in range(14)])
DATA = [
    EngineDatum(
        tokens=tuple(t[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(t[1:], np.int64),
            "weights": np.ones(len(t) - 1, np.float32),
        },
    )
    for t in TOKENS
]


def registered(arch: str, root: Path) -> BaseModelInfo:
    folder = tiny_models.model_folder(arch, root / arch)
    return model_files.inspect_folder(f"t/{arch}", folder, model_files.Options())


def bf16_engine(info: BaseModelInfo, root: Path) -> Engine:
    return Engine(
        cache_dir=root / "cache", device="cpu", dtype=BF16, models={info.name: info}.__getitem__
    )


def random_adapter(engine: Engine, name: str, base_model: str, seed: int) -> dict[str, np.ndarray]:
    """A fresh adapter with every tensor random (every delta nonzero), in float32 values that
    bfloat16 cannot hold (so the masters' precision shows); returns them."""
    engine.create_adapter(name, base_model, LoraSpec(4, 8.0, seed=seed))
    rng = np.random.default_rng(seed)
    weights = {
        k: rng.normal(0, 0.1, v.shape).astype(np.float32)
        for k, v in engine.adapter_weights(name).items()
    }
    engine.set_adapter_weights(name, weights)
    return weights


@pytest.mark.parametrize("arch", DENSE)
def test_bf16_loss_and_lora_grads_equal_peft_in_bf16(arch: str, tmp_path: Path) -> None:
    info = registered(arch, tmp_path)
    engine = bf16_engine(info, tmp_path)
    weights = random_adapter(engine, "a", info.name, seed=3)
    result = engine.forward_backward("a", DATA, "cross_entropy")
    assert result.pass_tokens >= 2 * 20  # one pass: one bfloat16 gradient, no sum of parts
    grads = engine.adapter_grads("a")

    model, _ = load_base_model(info, tmp_path / "cache", "cpu", BF16)
    targets = resolve(model)
    config = LoraConfig(
        r=SPEC.rank,
        lora_alpha=SPEC.alpha,
        target_modules=list(targets.suffixes(SPEC)),
        lora_dropout=0.0,
    )
    twin = get_peft_model(model, config, autocast_adapter_dtype=False)
    theirs = {n.replace(".default.", "."): p for n, p in twin.named_parameters() if ".lora_" in n}
    assert set(theirs) == set(weights)
    with torch.no_grad():
        for name, tensor in theirs.items():
            assert tensor.dtype == BF16  # peft computes the adapter in bfloat16
            tensor.copy_(torch.from_numpy(weights[name]))
    arrays = validate_data(DATA, CROSS_ENTROPY, vocab_size=256, max_context_length=512)
    _, loss = batch_loss(twin, arrays, CROSS_ENTROPY, resolve_config(CROSS_ENTROPY.spec, None))
    loss.backward()

    assert result.metrics["loss:sum"] == float(loss.detach())
    for name, tensor in theirs.items():
        assert tensor.grad is not None
        assert grads[name].dtype == np.float32  # the master's grad
        assert torch.equal(torch.from_numpy(grads[name]), tensor.grad.float()), name


def saved_float32_bytes(run: Callable[[], torch.Tensor], skip: set[int]) -> int:
    """Bytes of the float32 storages autograd saves for the backward while `run` runs (each
    storage once, those in `skip`, the model's own weights, left out)."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if tensor.dtype == torch.float32 and storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()  # kept until counted: its graph holds what was saved
    del out
    return sum(saved.values())


def test_a_bf16_lora_saves_no_float32_activations_beyond_the_base_models_own() -> None:
    model = build("llama3").to(BF16)
    model.requires_grad_(False)
    host = LoraHost(model)
    masters = host.new_weights(SPEC, torch.device("cpu"))
    assert compute_dtype(BF16) == BF16 and compute_dtype(torch.float32) == torch.float32
    ids_B_T = torch.tensor([TOKENS[0]])
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    decoder = model.get_decoder()

    def forward(adapter: LoraWeights | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            # the embeddings take grads in place of earlier layers' LoRA: every layer's
            # activations are saved, as in a training pass
            embeds = decoder.embed_tokens(ids_B_T).detach().requires_grad_(True)
            with host.use(adapter):
                return decoder(inputs_embeds=embeds, use_cache=False).last_hidden_state

        return run

    bare = saved_float32_bytes(forward(None), weights)  # the norms compute in float32
    in_bf16 = saved_float32_bytes(forward(masters.in_dtype(BF16)), weights)
    in_fp32 = saved_float32_bytes(forward(masters), weights)  # the engine before: +2.4 KB/token
    assert in_bf16 == bare > 0
    assert in_fp32 > bare + 20 * 2 * 32 * 4  # at least one hidden-sized copy per layer


def test_a_step_updates_the_float32_masters_and_the_copy_the_next_pass_runs(
    tmp_path: Path,
) -> None:
    info = registered("llama3", tmp_path)
    engine = bf16_engine(info, tmp_path)
    random_adapter(engine, "a", info.name, seed=3)
    engine.forward_backward("a", DATA, "cross_entropy")
    before = engine.adapter_weights("a")
    engine.optim_step("a", AdamSpec(learning_rate=1e-3))
    stepped = engine.adapter_weights("a")
    for name, value in stepped.items():
        assert value.dtype == np.float32
        assert not np.array_equal(value, before[name]), name
        # steps of 1e-3 on bfloat16 weights (8 bits of mantissa) would mostly round away
        assert not np.array_equal(value, torch.from_numpy(value).to(BF16).float().numpy())

    # a fresh adapter given the stepped masters runs what the stepped one runs next
    engine.create_adapter("b", info.name, LoraSpec(4, 8.0, seed=9))
    engine.set_adapter_weights("b", stepped)
    ours = engine.forward_backward("a", DATA, "cross_entropy", forward_only=True)
    fresh = engine.forward_backward("b", DATA, "cross_entropy", forward_only=True)
    assert ours.metrics == fresh.metrics
    for x, y in zip(ours.outputs, fresh.outputs, strict=True):
        np.testing.assert_array_equal(x["logprobs"], y["logprobs"])


def test_bf16_snapshots_sample_in_a_batch_as_alone_and_score_as_the_forward(
    tmp_path: Path,
) -> None:
    info = registered("llama3", tmp_path)
    engine = bf16_engine(info, tmp_path)
    for i, adapter in enumerate("ab"):
        random_adapter(engine, adapter, info.name, seed=i)
        engine.snapshot(adapter, f"s{adapter}")
    prompt = [5, 17, 42, 99, 7, 123, 64, 11]
    params = SamplingSpec(max_tokens=6, temperature=1.0, seed=11, stop=())
    requests = [SampleRequest(info.name, s, prompt, 2, params) for s in ("sa", "sb", None)]
    alone = [engine.sample_batch([r])[0] for r in requests]
    together = engine.sample_batch(requests)  # two snapshots and the base model in one batch
    for one, batched in zip(alone, together, strict=True):
        assert not isinstance(one, Exception) and not isinstance(batched, Exception)
        # the same draws; logprobs bfloat16 rounding apart (a batch of several adapters adds
        # the deltas with batched products, one adapter alone with one fused product)
        for x, y in zip(one.sequences, batched.sequences, strict=True):
            assert x.tokens == y.tokens
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=2e-2)

    scored = engine.sample(info.name, "sa", prompt, 1, params, prompt_logprobs=True)
    datum = EngineDatum(
        tokens=tuple(prompt[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(prompt[1:], np.int64),
            "weights": np.ones(len(prompt) - 1, np.float32),
        },
    )
    forward = engine.forward_backward("a", [datum], "cross_entropy", forward_only=True)
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    # the sampler adds the delta with one fused product, the forward with two: bfloat16
    # rounding (8 bits of mantissa) apart, no more
    np.testing.assert_allclose(
        np.array(scored.prompt_logprobs[1:], np.float32),
        forward.outputs[0]["logprobs"],
        rtol=0,
        atol=2e-2,
    )


def test_a_bf16_adapter_paged_out_to_disk_trains_on_as_one_never_paged(tmp_path: Path) -> None:
    info = registered("llama3", tmp_path)
    adam = AdamSpec(learning_rate=1e-2)
    paged = Engine(
        cache_dir=tmp_path / "cache",
        device="cpu",
        dtype=BF16,
        models={info.name: info}.__getitem__,
        max_loaded_adapters=1,
        spill_dir=tmp_path / "spill",
    )
    alone = bf16_engine(info, tmp_path)
    for engine in (paged, alone):
        random_adapter(engine, "a", info.name, seed=3)
        engine.forward_backward("a", DATA, "cross_entropy")
        engine.optim_step("a", adam)  # the copy now holds the stepped weights
    random_adapter(paged, "b", info.name, seed=4)  # pages "a" out, its copy with it
    assert list(paged.spilled_adapters()) == ["a"]
    for engine in (paged, alone):  # "a" back from disk: a copy of the masters read back
        engine.forward_backward("a", DATA, "cross_entropy")
        engine.optim_step("a", adam)
    parts = ("weights", "optimizer")
    assert paged.state_hashes("a", parts) == alone.state_hashes("a", parts)
