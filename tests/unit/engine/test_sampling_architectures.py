"""Batched decoding on every architecture Treadle is tested on (tests/architectures.py),
sliding-window ones included, with prompts and continuations longer than their window: a job's
tokens are the same alone and inside a left-padded batch that another job joins mid-decoding, and
its logprobs (sampled and prompt) are those of one plain forward pass without a cache, with a LoRA
adapter (on MoE models, on their experts too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from tests.architectures import ARCHITECTURES, MOE, SLIDING, build
from treadle.engine.lora.adapters import LoraHost, LoraSpec, LoraWeights
from treadle.engine.sampling.decode import DecodeBatch, SampleJob, generate_batch
from treadle.engine.sampling.prompt_scores import PromptScoring
from treadle.engine.sampling.rules import SampleResult, SamplingSpec
from treadle.platform.errors import ValidationError

WINDOW = 16  # the tiny sliding configs' sliding_window
NEW_TOKENS = 12
CPU = torch.device("cpu")


@dataclass
class Arch:
    model: PreTrainedModel
    host: LoraHost
    lora: LoraWeights | None


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> Arch:
    """The tiny model of one architecture with a LoRA adapter (attention, MLP or experts, and
    unembedding) whose B is not zero."""
    model = build(request.param)
    host = LoraHost(model)
    lora = host.new_weights(LoraSpec(rank=4, alpha=8.0), CPU)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for b in lora.B.values():
            b.copy_(torch.randn(b.shape, generator=generator) * 0.2)
    return Arch(model, host, lora)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(1, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _job(
    arch: Arch,
    length: int,
    seed: int,
    *,
    samples: int = 1,
    temperature: float = 1.0,
    max_tokens: int = NEW_TOKENS,
    lora: bool = True,
) -> SampleJob:
    params = SamplingSpec(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=())
    return SampleJob(
        _prompt(length, seed),
        samples,
        params,
        PromptScoring(logprobs=True),
        weights=arch.lora if lora else None,
    )


def _decode(ids: list[int]) -> str:
    return ""  # no stop strings in these jobs


def _alone(arch: Arch, job: SampleJob) -> SampleResult:
    (out,) = generate_batch(arch.model, arch.host, [job], eos_token_id=None, decode=_decode)
    assert isinstance(out, SampleResult)
    return out


def _forward_logprobs(arch: Arch, tokens: Sequence[int], lora: LoraWeights | None) -> np.ndarray:
    """log p(tokens[i] | tokens[:i]) for i >= 1, from one forward pass without a cache."""
    with torch.no_grad(), arch.host.use(lora):
        logits_T_V = arch.model(input_ids=torch.tensor([list(tokens)]), use_cache=False).logits[0]
    logprobs_T_V = torch.log_softmax(logits_T_V.float(), dim=-1)
    return logprobs_T_V[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()


def test_job_alone_equals_inside_a_padded_batch_that_a_job_joins(arch: Arch) -> None:
    """The target job (20 tokens, two samples) is left-padded by a longer neighbour, beside a
    short one on the base model and one that leaves early; a fourth joins after 3 steps."""
    first = [
        _job(arch, 20, 1, samples=2),
        _job(arch, 7, 2, temperature=0.0, lora=False),
        _job(arch, 23, 3, temperature=0.7, max_tokens=5),
    ]
    joiner = _job(arch, 18, 4)
    batch = DecodeBatch(arch.model, arch.host, eos_token_id=None, decode=_decode)
    results = dict(batch.add(list(enumerate(first))))
    for _ in range(3):
        results.update(batch.step())
    results.update(batch.add([(3, joiner)]))
    while len(batch):
        results.update(batch.step())
    assert sorted(results) == [0, 1, 2, 3]
    for key, job in enumerate([*first, joiner]):
        alone, batched = _alone(arch, job), results[key]
        assert isinstance(batched, SampleResult)
        for one, other in zip(alone.sequences, batched.sequences, strict=True):
            assert len(one.tokens) == job.params.max_tokens
            assert one.tokens == other.tokens
            np.testing.assert_allclose(one.logprobs, other.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1"])
def test_logprobs_equal_one_forward_pass_without_a_cache(arch: Arch, temperature: float) -> None:
    """Sample and prompt logprobs of a LoRA job left-padded by a longer base-model neighbour."""
    job = _job(arch, 20, 6, samples=2, temperature=temperature)
    neighbour = _job(arch, 26, 7, lora=False)
    out, _ = generate_batch(
        arch.model, arch.host, [job, neighbour], eos_token_id=None, decode=_decode
    )
    assert isinstance(out, SampleResult) and out.prompt_logprobs is not None
    assert len(job.prompt) + NEW_TOKENS > WINDOW + 10  # well past the window
    for seq in out.sequences:
        assert len(seq.tokens) == NEW_TOKENS
        expected = _forward_logprobs(arch, [*job.prompt, *seq.tokens], arch.lora)
        np.testing.assert_allclose(seq.logprobs, expected[len(job.prompt) - 1 :], atol=1e-5)
        np.testing.assert_allclose(
            out.prompt_logprobs[1:], expected[: len(job.prompt) - 1], atol=1e-5
        )


def test_adapter_changes_the_logprobs(arch: Arch) -> None:
    """Precondition of the tests above: the adapter is not the base model."""
    tokens = _prompt(32, 8)
    with_lora = _forward_logprobs(arch, tokens, arch.lora)
    assert not np.allclose(with_lora, _forward_logprobs(arch, tokens, None), atol=1e-3)


@pytest.mark.parametrize("name", sorted(MOE))
def test_an_experts_only_adapter_samples_with_its_experts(name: str) -> None:
    """An adapter on a MoE model's experts alone (nonzero B): its sampled and prompt logprobs,
    alone (one adapter on every row) and beside a base-model neighbour (an adapter per row),
    are those of a forward pass with it, and not the base model's."""
    model = build(name)
    host = LoraHost(model)
    spec = LoraSpec(rank=4, alpha=8.0, train_attn=False, train_unembed=False)
    lora = host.new_weights(spec, CPU)
    assert lora.A and all(":" in key for key in lora.A)  # expert parameters only
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for b in lora.B.values():
            b.copy_(torch.randn(b.shape, generator=generator) * 0.2)
    arch = Arch(model, host, lora)
    job = _job(arch, 20, 6, samples=2)
    neighbour = _job(arch, 26, 7, lora=False)
    alone = _alone(arch, job)
    beside, _ = generate_batch(model, host, [job, neighbour], eos_token_id=None, decode=_decode)
    for out in (alone, beside):
        assert isinstance(out, SampleResult) and out.prompt_logprobs is not None
        for seq in out.sequences:
            tokens = [*job.prompt, *seq.tokens]
            expected = _forward_logprobs(arch, tokens, lora)
            np.testing.assert_allclose(seq.logprobs, expected[len(job.prompt) - 1 :], atol=1e-5)
            np.testing.assert_allclose(
                out.prompt_logprobs[1:], expected[: len(job.prompt) - 1], atol=1e-5
            )
            assert not np.allclose(expected, _forward_logprobs(arch, tokens, None), atol=1e-3)


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_window_hides_the_start_of_a_long_sequence(name: str) -> None:
    """Precondition of the tests above: 32 tokens reach past the window, so a cache that let
    sliding layers see every earlier token would be caught."""
    model = build(name)
    arch = Arch(model, LoraHost(model), None)
    tokens = _prompt(32, 8)
    with_window = _forward_logprobs(arch, tokens, None)
    assert model.config.sliding_window == WINDOW
    model.config.sliding_window = 1000
    without = _forward_logprobs(arch, tokens, None)
    np.testing.assert_allclose(with_window[: WINDOW - 1], without[: WINDOW - 1], atol=1e-5)
    assert not np.allclose(with_window[WINDOW:], without[WINDOW:], atol=1e-3)


def test_sliding_names_the_windowed_architectures() -> None:
    windowed = {n for n in ARCHITECTURES if getattr(build(n).config, "sliding_window", None)}
    assert windowed == SLIDING


def test_a_model_with_other_attention_layers_is_refused() -> None:
    model = build("llama3")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValidationError, match="linear_attention"):
        DecodeBatch(model, LoraHost(model), eos_token_id=None, decode=_decode)


def test_registration_admits_the_layer_types_the_sampler_caches() -> None:
    """One rule in two places (the API cannot import the engine): the layer types registration
    admits (platform/models/structure.py) are the ones the decode loop serves."""
    from treadle.engine.sampling import decode
    from treadle.platform.models.structure import CACHED_LAYER_TYPES

    assert CACHED_LAYER_TYPES == decode._LAYER_TYPES


def test_a_sample_alone_equals_it_among_other_architectures_requests_on_one_engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """One worker's engine hosting every registered architecture of tests/architectures.py: each request sampled
    alone returns the tokens and logprobs it returns inside one `sample_batch` with the other
    architectures' requests and another request on its own base (one adapted by a snapshot,
    one on the base alone, of different prompt lengths)."""
    from tests import tiny_models
    from treadle.engine import Engine
    from treadle.engine.sampling.decode import SampleRequest
    from treadle.platform.models import model_files

    root = tmp_path_factory.mktemp("registered")
    infos = {
        f"t/{arch}": model_files.inspect_folder(
            f"t/{arch}", tiny_models.model_folder(arch, root / arch), model_files.Options()
        )
        for arch in ARCHITECTURES
    }
    engine = Engine(cache_dir=root / "cache", device="cpu", models=infos.__getitem__)
    requests = []
    for i, (name, info) in enumerate(infos.items()):
        spec = LoraSpec(rank=4, alpha=8, seed=i, train_mlp="mlp" in info.lora_targets)
        engine.create_adapter(name, name, spec)
        engine.set_adapter_weights(
            name,
            {
                k: np.random.default_rng(i).normal(0, 0.1, v.shape).astype(np.float32)
                for k, v in engine.adapter_weights(name).items()
            },
        )
        engine.snapshot(name, f"{name}:snap")
        for j, snapshot in enumerate((f"{name}:snap", None)):  # adapted, and the base alone
            params = SamplingSpec(max_tokens=10, temperature=1.0, seed=20 + 2 * i + j)
            prompt = list(range(3 + i, 20 + 2 * i + 5 * j))  # lengths differ: left padding
            requests.append(SampleRequest(name, snapshot, prompt, 2, params))
    alone = [engine.sample_batch([r])[0] for r in requests]
    together = engine.sample_batch(requests)
    for request, a, b in zip(requests, alone, together, strict=True):
        assert isinstance(a, SampleResult) and isinstance(b, SampleResult), (a, b)
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences], request
        for x, y in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
