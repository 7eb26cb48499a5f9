"""The engine's invariants on the tiny debug model (CPU), plus one slow test on real SmolLM2."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import (
    ADAM,
    DATA,
    GRAD_PROBE,
    LORA,
    TINY,
    bare_model,
    ce_datum,
    logprobs,
    new_adapter,
    randomise_b,
    train,
)

from treadle.engine import AdamSpec, Engine, EngineDatum, LoraSpec, SamplingSpec
from treadle.engine.losses.functions import (
    MICROBATCH_LOGITS,
    MICROBATCH_TOKENS,
    microbatches,
    padded_tokens,
)
from treadle.engine.losses.passes import cpu_pass_tokens
from treadle.engine.models import loading as models
from treadle.platform.errors import ConflictError, NotFoundError, ValidationError
from treadle.platform.models.catalog import SMOLLM2_NAME


def bare_base_logprobs(cache_dir: Path, datum: EngineDatum) -> np.ndarray:
    """Target logprobs from a freshly built tiny model with no LoRA machinery, in plain PyTorch."""
    with torch.no_grad():
        logits_T_V = bare_model(cache_dir)(torch.tensor([datum.tokens])).logits[0].float()
    targets_T = torch.from_numpy(np.asarray(datum.loss_fn_inputs["target_tokens"]))
    return torch.log_softmax(logits_T_V, dim=-1).gather(-1, targets_T[:, None])[:, 0].numpy()


# -- initialisation ------------------------------------------------------------------------------


def test_same_init_gives_identical_logprobs(engine: Engine, cache_dir: Path) -> None:
    other = Engine(cache_dir=cache_dir, device="cpu")
    a, b = new_adapter(engine), new_adapter(other)
    assert engine.weight_hash(a) == other.weight_hash(b)
    train(engine, a, 1)
    train(other, b, 1)
    for x, y in zip(logprobs(engine, a, DATA), logprobs(other, b, DATA), strict=True):
        np.testing.assert_array_equal(x, y)


def test_lora_seed_changes_init(engine: Engine) -> None:
    a = new_adapter(engine, LoraSpec(rank=4, alpha=8.0, seed=1))
    b = new_adapter(engine, LoraSpec(rank=4, alpha=8.0, seed=2))
    assert engine.weight_hash(a) != engine.weight_hash(b)


def test_fresh_adapter_equals_bare_base_model(engine: Engine, cache_dir: Path) -> None:
    adapter = new_adapter(engine)
    lp = logprobs(engine, adapter, DATA[:1])[0]
    expected = bare_base_logprobs(cache_dir, DATA[0])
    np.testing.assert_allclose(lp, expected, rtol=0, atol=1e-6)
    via_sampler = engine.sample(
        TINY, None, DATA[0].tokens, 1, SamplingSpec(max_tokens=0), prompt_logprobs=True
    )
    assert via_sampler.prompt_logprobs is not None
    np.testing.assert_allclose(via_sampler.prompt_logprobs[1:], expected[:-1], atol=1e-5)


def test_only_selected_parts_get_lora(engine: Engine) -> None:
    adapter = new_adapter(
        engine, LoraSpec(rank=2, alpha=2.0, train_attn=False, train_unembed=False)
    )
    names = engine.adapter_weights(adapter)
    assert names and all(".mlp." in name for name in names)
    assert engine.adapter_weights(adapter)[next(iter(names))].shape[0] == 2


# -- losses and training -------------------------------------------------------------------------


def test_forward_reports_float32_outputs_per_datum(engine: Engine) -> None:
    out = engine.forward_backward(new_adapter(engine), DATA, "cross_entropy", forward_only=True)
    assert out.train_tokens == sum(len(d.tokens) for d in DATA)
    assert [len(o["logprobs"]) for o in out.outputs] == [len(d.tokens) for d in DATA]
    for o in out.outputs:
        assert o["logprobs"].dtype == o["elementwise_loss"].dtype == np.float32
    total = sum(float(o["elementwise_loss"].sum()) for o in out.outputs)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-6)


def test_optim_steps_lower_the_loss(engine: Engine) -> None:
    adapter = new_adapter(engine)
    losses = []
    for _ in range(4):
        losses.append(
            engine.forward_backward(adapter, DATA[:1], "cross_entropy").metrics["loss:sum"]
        )
        metrics = engine.optim_step(adapter, ADAM)
    assert losses[-1] < losses[0] - 1.0
    assert metrics["grad_norm:mean"] > 0 and metrics["learning_rate:mean"] == ADAM.learning_rate


def test_training_one_adapter_never_touches_another(engine: Engine, cache_dir: Path) -> None:
    trained, bystander = new_adapter(engine), new_adapter(engine)
    train(engine, bystander, 1)
    before = logprobs(engine, bystander, DATA)
    engine.forward_backward(bystander, DATA[:2], "cross_entropy")  # pending grads
    pending = engine.adapter_grads(bystander)
    train(engine, trained, 3)
    engine.snapshot(trained, "other-snap")
    engine.sample(TINY, "other-snap", [1, 2, 3], 2, SamplingSpec(max_tokens=3, seed=0))
    for x, y in zip(before, logprobs(engine, bystander, DATA), strict=True):
        np.testing.assert_array_equal(x, y)
    for name, grad in engine.adapter_grads(bystander).items():
        np.testing.assert_array_equal(grad, pending[name], err_msg=name)
    engine.optim_step(bystander, ADAM)
    # The same history without the neighbour's training and sampling, on a separate engine.
    alone = Engine(cache_dir=cache_dir, device="cpu")
    reference = new_adapter(alone)
    train(alone, reference, 1)
    alone.forward_backward(reference, DATA[:2], "cross_entropy")
    alone.optim_step(reference, ADAM)
    assert engine.weight_hash(bystander) == alone.weight_hash(reference)


def test_two_half_batches_accumulate_like_one_batch(engine: Engine) -> None:
    halves, whole = new_adapter(engine), new_adapter(engine)
    a = engine.forward_backward(halves, DATA[:2], "cross_entropy").metrics["loss:sum"]
    b = engine.forward_backward(halves, DATA[2:], "cross_entropy").metrics["loss:sum"]
    both = engine.forward_backward(whole, DATA, "cross_entropy").metrics["loss:sum"]
    assert a + b == pytest.approx(both, abs=1e-4)
    engine.optim_step(halves, GRAD_PROBE)
    engine.optim_step(whole, GRAD_PROBE)
    for (name, x), y in zip(
        engine.adapter_weights(halves).items(), engine.adapter_weights(whole).values(), strict=True
    ):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6, err_msg=name)


def test_microbatches_keep_their_logits_within_the_bound() -> None:
    def datum(n: int) -> dict[str, np.ndarray]:
        return {"tokens": np.zeros(n, np.int64)}

    vocab = 49_152  # the CPU's budget: MICROBATCH_LOGITS // vocab = 682 padded tokens a pass
    budget = cpu_pass_tokens(vocab)
    groups = microbatches([datum(n) for n in (300, 300, 300, 100, 50, 2000, 10)], budget)
    assert [[len(a["tokens"]) for a in g] for g in groups] == [
        [300, 300],
        [300, 100],
        [50],
        [2000],
        [10],
    ]  # a datum longer than the bound runs alone
    assert all(padded_tokens(g) * vocab <= MICROBATCH_LOGITS for g in groups if len(g) > 1)
    small = microbatches([datum(300)] * 6, cpu_pass_tokens(1000))  # the token bound rules
    assert len(small) == 1 and padded_tokens(small[0]) <= MICROBATCH_TOKENS


def test_a_batch_run_in_several_passes_equals_its_passes_as_calls(engine: Engine) -> None:
    """A batch larger than one pass's token budget (500 here, so three small data split):
    the grads of its passes add up like separate calls on its parts (what the split must not
    change)."""
    rng = np.random.default_rng(5)
    data = [ce_datum([int(t) for t in rng.integers(1, 49_000, n)]) for n in (400, 390, 380)]
    assert len(microbatches([{"tokens": np.asarray(d.tokens)} for d in data], 500)) == 3
    parts, whole = new_adapter(engine), new_adapter(engine)
    randomise_b(engine, parts, seed=1)
    randomise_b(engine, whole, seed=1)
    losses = [
        engine.forward_backward(parts, [d], "cross_entropy").metrics["loss:sum"] for d in data
    ]
    together = engine.forward_backward(whole, data, "cross_entropy", pass_tokens=500)
    assert together.pass_tokens == 500
    both = together.metrics["loss:sum"]
    assert sum(losses) == pytest.approx(both, rel=1e-6)
    for (name, x), y in zip(
        engine.adapter_grads(parts).items(), engine.adapter_grads(whole).values(), strict=True
    ):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7, err_msg=name)


def test_forward_only_changes_no_state(engine: Engine) -> None:
    probed, twin = new_adapter(engine), new_adapter(engine)
    train(engine, probed, 1)
    train(engine, twin, 1)
    before = engine.weight_hash(probed)
    forward = engine.forward_backward(probed, DATA, "cross_entropy", forward_only=True)
    assert engine.weight_hash(probed) == before
    engine.optim_step(probed, ADAM)  # would apply grads if forward_only had left any
    engine.optim_step(twin, ADAM)
    assert engine.weight_hash(probed) == engine.weight_hash(twin)
    with_grad = engine.forward_backward(twin, DATA, "cross_entropy")
    assert with_grad.metrics["loss:sum"] != forward.metrics["loss:sum"]  # the step did move


def test_weight_decay_is_decoupled(engine: Engine) -> None:
    adapter = new_adapter(engine)  # no grads: Adam's own update is 0, only the decay acts
    before = engine.adapter_weights(adapter)
    engine.optim_step(adapter, AdamSpec(learning_rate=0.1, weight_decay=0.5))
    for name, after in engine.adapter_weights(adapter).items():
        np.testing.assert_allclose(after, before[name] * (1 - 0.1 * 0.5), rtol=1e-6, err_msg=name)


def test_grad_clipping_scales_the_global_norm(engine: Engine) -> None:
    clipped, free = new_adapter(engine), new_adapter(engine)
    # eps >> |g|: the first update is lr * g / eps, linear in the (clipped) gradient
    linear = AdamSpec(learning_rate=1e6, eps=1e6)
    engine.forward_backward(free, DATA, "cross_entropy")
    norm = engine.optim_step(free, linear)["grad_norm:mean"]
    engine.forward_backward(clipped, DATA, "cross_entropy")
    reported = engine.optim_step(
        clipped, AdamSpec(learning_rate=1e6, eps=1e6, grad_clip_norm=norm / 4)
    )
    assert reported["grad_norm:mean"] == pytest.approx(norm)  # the norm before clipping
    start = engine.adapter_weights(new_adapter(engine))
    for name, w_free in engine.adapter_weights(free).items():
        w_clipped = engine.adapter_weights(clipped)[name]
        np.testing.assert_allclose(
            w_clipped - start[name], (w_free - start[name]) / 4, rtol=1e-4, atol=1e-7
        )


@pytest.mark.parametrize(
    ("loss_fn", "config", "words"),
    [
        ("ppo", {"clip_low": 0.8}, ["clip_low", "clip_high_threshold"]),
        ("ppo", {"clip_high_threshold": 20.0}, ["clip_high_threshold", "10"]),
        ("cross_entropy", {"beta": 0.1}, ["beta", "none"]),
    ],
)
def test_bad_loss_fn_config_is_rejected(
    engine: Engine, loss_fn: str, config: dict[str, float], words: list[str]
) -> None:
    with pytest.raises(ValidationError) as info:
        engine.forward_backward(new_adapter(engine), DATA, loss_fn, config)
    for word in words:
        assert word in str(info.value)


# -- validation ----------------------------------------------------------------------------------


def _bad(field: str) -> EngineDatum:
    good = DATA[1]
    inputs = dict(good.loss_fn_inputs)
    tokens = good.tokens
    if field == "weights":
        inputs["weights"] = np.ones(5, np.float32)
    elif field == "missing":
        del inputs["weights"]
    elif field == "target_tokens":
        inputs["target_tokens"] = np.array([1, 49152], np.int64)
    elif field == "model_input":
        tokens = (-1, 3)
    elif field == "empty":
        tokens, inputs = (), {"target_tokens": np.zeros(0, np.int64), "weights": np.zeros(0)}
    elif field == "too long":
        n = 2049
        tokens, inputs = (1,) * n, {"target_tokens": np.ones(n, np.int64), "weights": np.ones(n)}
    return EngineDatum(tokens=tokens, loss_fn_inputs=inputs)


@pytest.mark.parametrize(
    ("field", "words"),
    [
        ("weights", ["weights", "5"]),
        ("missing", ["weights", "lacks"]),
        ("target_tokens", ["target_tokens[1]", "49152"]),
        ("model_input", ["model_input[0]", "-1"]),
        ("empty", ["empty"]),
        ("too long", ["2049", "2048"]),
    ],
)
def test_validation_error_names_datum_and_field(
    engine: Engine, field: str, words: list[str]
) -> None:
    adapter = new_adapter(engine)
    with pytest.raises(ValidationError) as info:
        engine.forward_backward(adapter, [DATA[0], DATA[1], _bad(field)], "cross_entropy")
    assert "datum 2" in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_unknown_loss_lists_known_losses(engine: Engine) -> None:
    with pytest.raises(ValidationError, match="cross_entropy.*ppo"):
        engine.forward_backward(new_adapter(engine), DATA, "mse")


def test_unknown_adapter_is_not_found(engine: Engine) -> None:
    with pytest.raises(NotFoundError):
        engine.forward_backward("no-such-adapter", DATA, "cross_entropy")
    with pytest.raises(NotFoundError):
        engine.sample(TINY, "no-such-snapshot", [1], 1, SamplingSpec())


def test_drop_adapter_drops_its_snapshots(engine: Engine) -> None:
    adapter = new_adapter(engine)
    engine.snapshot(adapter, "dropped-snap")
    engine.drop_adapter(adapter)
    assert not engine.has_adapter(adapter) and not engine.has_snapshot("dropped-snap")


def test_duplicate_adapter_id_conflicts(engine: Engine) -> None:
    adapter = new_adapter(engine)
    with pytest.raises(ConflictError):
        engine.create_adapter(adapter, TINY, LORA)


@pytest.mark.parametrize(
    ("lora", "word"),
    [
        (LoraSpec(rank=0, alpha=1.0), "rank"),
        (LoraSpec(rank=2, alpha=0.0), "alpha"),
        (
            LoraSpec(rank=2, alpha=1.0, train_attn=False, train_mlp=False, train_unembed=False),
            "all",
        ),
    ],
)
def test_bad_lora_config_is_rejected(engine: Engine, lora: LoraSpec, word: str) -> None:
    with pytest.raises(ValidationError, match=word):
        new_adapter(engine, lora)


def test_bad_adam_params_are_rejected(engine: Engine) -> None:
    adapter = new_adapter(engine)
    with pytest.raises(ValidationError, match="beta1.*eps"):
        engine.optim_step(adapter, AdamSpec(beta1=1.0, eps=-1.0))


# -- adapter weights and residency ---------------------------------------------------------------


def test_set_adapter_weights_round_trips_and_checks_shapes(engine: Engine) -> None:
    adapter = new_adapter(engine)
    randomise_b(engine, adapter, seed=1)
    weights = engine.adapter_weights(adapter)
    other = new_adapter(engine)
    engine.set_adapter_weights(other, weights)
    assert engine.weight_hash(other) == engine.weight_hash(adapter)
    for x, y in zip(logprobs(engine, adapter, DATA), logprobs(engine, other, DATA), strict=True):
        np.testing.assert_array_equal(x, y)
    name = next(iter(weights))
    with pytest.raises(ValidationError, match="shape"):
        engine.set_adapter_weights(other, {**weights, name: weights[name][:1]})
    with pytest.raises(ValidationError, match="missing"):
        engine.set_adapter_weights(other, {k: v for k, v in weights.items() if k != name})
    assert engine.weight_hash(other) == engine.weight_hash(adapter)  # nothing half-written


def test_adapters_beyond_the_resident_limit_are_kept(cache_dir: Path) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_resident_adapters=2)
    ids = [new_adapter(engine) for _ in range(4)]
    assert engine.resident_adapters() == ids[2:]
    logprobs(engine, ids[0], DATA[:1])
    assert engine.resident_adapters() == [ids[3], ids[0]]  # least recently used first
    assert all(engine.has_adapter(a) for a in ids)  # moved off, never dropped
    engine.drop_adapter(ids[0])
    assert engine.resident_adapters() == [ids[3]]


def test_evicted_adapter_comes_back_unchanged_and_keeps_training(cache_dir: Path) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_resident_adapters=1)
    adapter = new_adapter(engine)
    train(engine, adapter, 2)
    engine.forward_backward(adapter, DATA[:2], "cross_entropy")  # grads pending over eviction
    before, pending = logprobs(engine, adapter, DATA), engine.adapter_grads(adapter)
    neighbour = new_adapter(engine)
    train(engine, neighbour, 2)
    assert engine.resident_adapters() == [neighbour]
    for x, y in zip(before, logprobs(engine, adapter, DATA), strict=True):
        np.testing.assert_array_equal(x, y)
    assert engine.resident_adapters() == [adapter]
    for name, grad in engine.adapter_grads(adapter).items():
        np.testing.assert_array_equal(grad, pending[name], err_msg=name)
    engine.optim_step(adapter, ADAM)
    train(engine, adapter, 1)
    # The same history on an engine that never evicts.
    alone = Engine(cache_dir=cache_dir, device="cpu")
    reference = new_adapter(alone)
    train(alone, reference, 2)
    alone.forward_backward(reference, DATA[:2], "cross_entropy")
    alone.optim_step(reference, ADAM)
    train(alone, reference, 1)
    assert engine.weight_hash(adapter) == alone.weight_hash(reference)


# -- the real model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_answers_and_second_load_uses_safetensors_cache(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Engine(cache_dir=cache_dir, device="cpu")
    tok = first.tokenizer(SMOLLM2_NAME)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    greedy = SamplingSpec(max_tokens=12, temperature=0.0)
    answer = first.sample(SMOLLM2_NAME, None, prompt, 1, greedy).sequences[0]
    assert tok.decode(answer.tokens, skip_special_tokens=True).strip()
    assert (
        cache_dir / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct" / "model.safetensors"
    ).is_file()

    def no_conversion(*_: object) -> None:
        raise AssertionError("the second load converted the GGUF again")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    started = time.perf_counter()
    second = Engine(cache_dir=cache_dir, device="cpu")
    again = second.sample(SMOLLM2_NAME, None, prompt, 1, greedy).sequences[0]
    assert again.tokens == answer.tokens
    assert time.perf_counter() - started < 30
