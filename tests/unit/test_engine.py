"""The engine's invariants on the tiny debug model (CPU), plus one slow test on real SmolLM2."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from treadle.gpu_worker import models  # noqa: E402
from treadle.gpu_worker.engine import (  # noqa: E402
    AdamSpec,
    Engine,
    EngineDatum,
    LoraSpec,
    SamplingSpec,
)
from treadle.platform.catalog import SMOLLM2_NAME, TINY_DEBUG_NAME  # noqa: E402
from treadle.platform.errors import NotFoundError, ValidationError  # noqa: E402
from treadle.platform.tokenizers import load_tokenizer  # noqa: E402

TINY = TINY_DEBUG_NAME
LORA = LoraSpec(rank=4, alpha=8.0, seed=3)
ADAM = AdamSpec(learning_rate=1e-2)
# For comparing gradients through a step: with eps = 1 the first Adam update is g / (|g| + 1),
# smooth in g. With a tiny eps it is ~sign(g), which turns float noise on near-zero grads into
# full-size differences.
GRAD_PROBE = AdamSpec(learning_rate=1.0, eps=1.0)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Same folder as test_catalog's fixture: the tokenizer is built once per test session.
    path = tmp_path_factory.getbasetemp() / "treadle-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def engine(cache_dir: Path) -> Engine:
    return Engine(cache_dir=cache_dir, device="cpu")


_counter = iter(range(10**6))


def new_adapter(engine: Engine, lora: LoraSpec = LORA) -> str:
    adapter_id = f"adapter-{next(_counter)}"
    engine.create_adapter(adapter_id, TINY, lora)
    return adapter_id


def ce_datum(tokens: Sequence[int], weights: Sequence[float] | None = None) -> EngineDatum:
    """A next-token datum over `tokens`: input tokens[:-1], targets tokens[1:]."""
    n = len(tokens) - 1
    w = np.ones(n, np.float32) if weights is None else np.asarray(weights, np.float32)
    return EngineDatum(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": w},
    )


DATA = [
    ce_datum([5, 17, 923, 4001, 12, 8]),
    ce_datum([100, 200, 300], [1.0, 0.5]),
    ce_datum([7, 7, 7, 7, 7, 7, 7, 7, 9]),
    ce_datum([49151, 0, 31, 2]),
]


def logprobs(engine: Engine, adapter_id: str, data: Sequence[EngineDatum]) -> list[np.ndarray]:
    out = engine.forward_backward(adapter_id, data, "cross_entropy", forward_only=True)
    return [o["logprobs"] for o in out.outputs]


def train(engine: Engine, adapter_id: str, steps: int, data: Sequence[EngineDatum] = DATA) -> None:
    for _ in range(steps):
        engine.forward_backward(adapter_id, data, "cross_entropy")
        engine.optim_step(adapter_id, ADAM)


def bare_base_logprobs(cache_dir: Path, datum: EngineDatum) -> torch.Tensor:
    """Target logprobs from a freshly built tiny model with no LoRA machinery, in plain PyTorch."""
    model = models.build_tiny_debug(load_tokenizer(TINY, cache_dir)).eval()
    with torch.no_grad():
        logits_T_V = model(torch.tensor([datum.tokens])).logits[0].float()
    targets_T = torch.from_numpy(np.asarray(datum.loss_fn_inputs["target_tokens"]))
    return torch.log_softmax(logits_T_V, dim=-1).gather(-1, targets_T[:, None])[:, 0]


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
    expected = bare_base_logprobs(cache_dir, DATA[0]).numpy()
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


def test_cross_entropy_matches_plain_pytorch(engine: Engine, cache_dir: Path) -> None:
    datum = ce_datum([11, 2222, 333, 44], [1.0, 0.5, 0.0])  # 3 input tokens
    out = engine.forward_backward(new_adapter(engine), [datum], "cross_entropy", forward_only=True)
    lp_T = bare_base_logprobs(cache_dir, datum)
    w_T = torch.tensor([1.0, 0.5, 0.0])
    assert out.metrics["loss:sum"] == pytest.approx(float(-(w_T * lp_T).sum()), abs=1e-5)
    np.testing.assert_allclose(out.outputs[0]["elementwise_loss"], (-w_T * lp_T).numpy(), atol=1e-5)
    np.testing.assert_allclose(out.outputs[0]["logprobs"], lp_T.numpy(), atol=1e-5)
    assert out.train_tokens == 3
    assert out.outputs[0]["logprobs"].dtype == np.float32


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
    train(engine, trained, 3)
    engine.snapshot(trained, "other-snap")
    engine.sample(TINY, "other-snap", [1, 2, 3], 2, SamplingSpec(max_tokens=3, seed=0))
    for x, y in zip(before, logprobs(engine, bystander, DATA), strict=True):
        np.testing.assert_array_equal(x, y)
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


def rl_datum(engine: Engine, adapter: str, advantages: Sequence[float]) -> EngineDatum:
    base = DATA[0]
    lp = logprobs(engine, adapter, [base])[0]
    q = lp + np.linspace(-0.3, 0.3, len(lp), dtype=np.float32)  # the "sampler" disagrees a bit
    return EngineDatum(
        tokens=base.tokens,
        loss_fn_inputs={
            "target_tokens": base.loss_fn_inputs["target_tokens"],
            "logprobs": q.astype(np.float32),
            "advantages": np.asarray(advantages, np.float32),
        },
    )


@pytest.mark.parametrize(
    ("loss_fn", "config"),
    [("importance_sampling", {}), ("ppo", {}), ("cispo", {}), ("dro", {"beta": 0.1})],
)
def test_rl_loss_matches_its_formula(
    engine: Engine, loss_fn: str, config: dict[str, float]
) -> None:
    adapter = new_adapter(engine)
    datum = rl_datum(engine, adapter, [1.0, -2.0, 0.5, 0.0, 3.0])
    out = engine.forward_backward(adapter, [datum], loss_fn, config, forward_only=True)
    lp = out.outputs[0]["logprobs"].astype(np.float64)
    q, adv = datum.loss_fn_inputs["logprobs"], datum.loss_fn_inputs["advantages"]
    r = np.exp(lp - q)
    expected = {
        "importance_sampling": -r * adv,
        "ppo": -np.minimum(r * adv, np.clip(r, 0.8, 1.2) * adv),
        "cispo": -np.clip(r, 0.8, 1.2) * lp * adv,
        "dro": -(lp * adv - 0.5 * 0.1 * (lp - q) ** 2),
    }[loss_fn]
    np.testing.assert_allclose(out.outputs[0]["elementwise_loss"], expected, rtol=1e-5, atol=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(expected.sum(), abs=1e-4)


def test_cispo_gradient_stops_at_the_ratio(engine: Engine) -> None:
    """d(cispo)/dθ = -clip(r)·A·∇lp: the same step as cross_entropy with weights clip(r)·A."""
    cispo, ce = new_adapter(engine), new_adapter(engine)
    datum = rl_datum(engine, cispo, [1.0, -2.0, 0.5, 0.0, 3.0])
    lp = engine.forward_backward(cispo, [datum], "cispo", forward_only=True).outputs[0]["logprobs"]
    r = np.exp(lp - datum.loss_fn_inputs["logprobs"])
    weights = np.clip(r, 0.8, 1.2) * datum.loss_fn_inputs["advantages"]
    engine.forward_backward(cispo, [datum], "cispo")
    engine.forward_backward(ce, [ce_datum([*DATA[0].tokens, 8], weights)], "cross_entropy")
    engine.optim_step(cispo, GRAD_PROBE)
    engine.optim_step(ce, GRAD_PROBE)
    for x, y in zip(
        engine.adapter_weights(cispo).values(), engine.adapter_weights(ce).values(), strict=True
    ):
        np.testing.assert_allclose(x, y, atol=1e-6)


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


# -- sampling ------------------------------------------------------------------------------------

PROMPT = [1, 9690, 198, 2683, 359, 253]


def test_greedy_sampling_is_deterministic(engine: Engine) -> None:
    greedy = SamplingSpec(max_tokens=6, temperature=0.0, stop=())
    first = engine.sample(TINY, None, PROMPT, 3, greedy)
    again = engine.sample(TINY, None, PROMPT, 1, greedy)
    assert len({tuple(s.tokens) for s in first.sequences}) == 1
    assert first.sequences[0].tokens == again.sequences[0].tokens
    assert first.prefill_tokens == len(PROMPT) and first.sample_tokens == 18


def test_fixed_seed_reproduces_and_seeds_differ(engine: Engine) -> None:
    def run(seed: int) -> list[list[int]]:
        params = SamplingSpec(max_tokens=5, seed=seed, top_k=50, top_p=0.9, stop=())
        return [s.tokens for s in engine.sample(TINY, None, PROMPT, 3, params).sequences]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_max_tokens_and_stop_tokens_end_sequences(engine: Engine) -> None:
    free = engine.sample(
        TINY, None, PROMPT, 1, SamplingSpec(max_tokens=5, temperature=0.0, stop=())
    )
    tokens = free.sequences[0].tokens
    assert len(tokens) == 5 and free.sequences[0].stop_reason == "length"
    stop_token = tokens[2]
    stopped = engine.sample(
        TINY, None, PROMPT, 1, SamplingSpec(max_tokens=5, temperature=0.0, stop=(stop_token,))
    ).sequences[0]
    assert stopped.tokens == tokens[: tokens.index(stop_token) + 1]  # the stop token is kept
    assert stopped.stop_reason == "stop"


def test_stop_string_ends_sequence(engine: Engine) -> None:
    tok = engine.tokenizer(TINY)
    free = engine.sample(
        TINY, None, PROMPT, 1, SamplingSpec(max_tokens=6, temperature=0.0, stop=())
    )
    text = tok.decode(free.sequences[0].tokens)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    for spec_stop in ((stop,), stop):  # a bare string means one stop string
        params = SamplingSpec(max_tokens=6, temperature=0.0, stop=spec_stop)
        seq = engine.sample(TINY, None, PROMPT, 1, params).sequences[0]
        assert seq.stop_reason == "stop" and stop in tok.decode(seq.tokens)
        assert stop not in tok.decode(seq.tokens[:-1])


def test_sample_logprobs_equal_forward_logprobs(engine: Engine) -> None:
    adapter = new_adapter(engine)
    train(engine, adapter, 2)
    engine.snapshot(adapter, "lp-snap")
    params = SamplingSpec(max_tokens=6, temperature=1.0, seed=5, stop=())
    result = engine.sample(TINY, "lp-snap", PROMPT, 2, params, prompt_logprobs=True)
    for seq in result.sequences:
        full = PROMPT + seq.tokens
        lp = logprobs(engine, adapter, [ce_datum(full)])[0]
        np.testing.assert_allclose(seq.logprobs, lp[len(PROMPT) - 1 :], atol=1e-4)
        assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
        np.testing.assert_allclose(result.prompt_logprobs[1:], lp[: len(PROMPT) - 1], atol=1e-4)


def test_snapshot_keeps_weights_from_snapshot_time(engine: Engine) -> None:
    adapter = new_adapter(engine)
    train(engine, adapter, 1)
    engine.snapshot(adapter, "frozen-snap")
    params = SamplingSpec(max_tokens=0)
    before = engine.sample(TINY, "frozen-snap", PROMPT, 1, params, prompt_logprobs=True)
    train(engine, adapter, 2)
    after = engine.sample(TINY, "frozen-snap", PROMPT, 1, params, prompt_logprobs=True)
    assert before.prompt_logprobs == after.prompt_logprobs
    lp_now = logprobs(engine, adapter, [ce_datum(PROMPT)])[0]
    assert not np.allclose(lp_now, np.asarray(before.prompt_logprobs[1:], np.float32))


def test_bad_sampling_params_are_rejected(engine: Engine) -> None:
    with pytest.raises(ValidationError, match="top_p"):
        engine.sample(TINY, None, PROMPT, 1, SamplingSpec(top_p=0.0))
    with pytest.raises(ValidationError, match="prompt"):
        engine.sample(TINY, None, [], 1, SamplingSpec())
    with pytest.raises(ValidationError, match="maximum context"):
        engine.sample(TINY, None, PROMPT, 1, SamplingSpec(max_tokens=2048))


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
