"""Engine check on a CUDA machine: the tiny debug model, SmolLM2 and a tiny random model of every
admitted architecture (tests/architectures.py, registered from folders written here) through the
engine in bfloat16.

Per model it trains a LoRA adapter on a few chat examples, samples from it, and prints the peak GPU
memory (torch.cuda.max_memory_allocated), the step times, the loss curve, sampling throughput and
the largest gap between sample logprobs and forward logprobs. Then the determinism check that
replay relies on (engine/models/determinism.py): the same `--determinism-steps` training steps
(forward_backward + optim_step), from the same adapter seed, run twice, and the adapter's state
hashes (weights, grads, Adam state: engine/memory/fingerprint.py) compared after every step.
Exits 1 if CUDA is missing, the engine is not in deterministic mode on CUDA, the loss does not
fall, the logprobs disagree beyond bfloat16's tolerance, or the two runs' hashes differ at any
step; 0 otherwise. `--device cpu` runs the same check in float32 on the CPU (a smoke test of the
script itself).

    python benchmarks/engine_cuda_check.py [--cache-dir DIR] [--steps N] [--models NAME ...]
        [--architectures NAME ... | --architectures none] [--device cuda|cpu]
        [--determinism-steps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from treadle.engine import (  # noqa: E402
    AdamSpec,
    Engine,
    EngineDatum,
    LoraSpec,
    SamplingSpec,
)
from treadle.platform.models import model_files  # noqa: E402
from treadle.platform.models.catalog import (  # noqa: E402
    SMOLLM2_NAME,
    TINY_DEBUG_NAME,
    BaseModelInfo,
    get_base_model,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import architectures, tiny_models  # noqa: E402

CHATS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What colour is the sky on a clear day?", "On a clear day the sky is blue."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is two plus three?", "Two plus three is five."),
]
# model -> (learning rate, largest allowed |sample logprob - forward logprob|)
SETTINGS = {TINY_DEBUG_NAME: (1e-2, 0.05), SMOLLM2_NAME: (1e-3, 0.5)}
ARCH_SETTINGS = (3e-3, 0.05)  # the tiny random models of each architecture


def chat_data(engine: Engine, model: str) -> list[EngineDatum]:
    """One next-token datum per chat, every target weighted 1."""
    tok = engine.tokenizer(model)
    data = []
    for question, answer in CHATS:
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        tokens = list(tok.apply_chat_template(messages, return_dict=False))
        data.append(
            EngineDatum(
                tokens=tuple(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.asarray(tokens[1:], np.int64),
                    "weights": np.ones(len(tokens) - 1, np.float32),
                },
            )
        )
    return data


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):  # type: ignore[no-untyped-def]
    synchronize()
    started = time.perf_counter()
    value = fn()
    synchronize()
    return value, time.perf_counter() - started


def architecture_models(folder: Path, names: list[str]) -> dict[str, BaseModelInfo]:
    """Registry entries of tiny random models of `names`, written under `folder`."""
    entries = {}
    for arch in names:
        name = f"tiny/{arch}"
        path = tiny_models.model_folder(arch, folder / arch)
        entries[name] = model_files.inspect_folder(name, path, model_files.Options())
    return entries


def check_model(engine: Engine, model: str, steps: int) -> list[str]:
    """Train, sample and compare on `model`; print what was measured; return the failures."""
    learning_rate, lp_tolerance = SETTINGS.get(model, ARCH_SETTINGS)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    mlp = "mlp" in engine.models(model).lora_targets
    spec = LoraSpec(rank=16, alpha=32, train_mlp=mlp)
    (_, load_s) = timed(lambda: engine.create_adapter(model, model, spec))
    data = chat_data(engine, model)
    adam = AdamSpec(learning_rate=learning_rate)
    losses, fb_times, step_times = [], [], []
    for _ in range(steps):
        out, fb_s = timed(lambda: engine.forward_backward(model, data, "cross_entropy"))
        _, step_s = timed(lambda: engine.optim_step(model, adam))
        losses.append(out.metrics["loss:sum"])
        fb_times.append(fb_s)
        step_times.append(step_s)
    engine.snapshot(model, f"{model}-snap")
    prompt = list(data[0].tokens[: len(data[0].tokens) // 2])
    params = SamplingSpec(max_tokens=64, temperature=1.0, seed=0, stop=())
    result, sample_s = timed(lambda: engine.sample(model, f"{model}-snap", prompt, 8, params))
    gap = 0.0
    for seq in result.sequences:
        full = prompt + seq.tokens
        datum = EngineDatum(
            tokens=tuple(full[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(full[1:], np.int64),
                "weights": np.ones(len(full) - 1, np.float32),
            },
        )
        lp = engine.forward_backward(model, [datum], "cross_entropy", forward_only=True)
        forward_lp = lp.outputs[0]["logprobs"][len(prompt) - 1 :]
        gap = max(gap, float(np.abs(np.asarray(seq.logprobs) - forward_lp).max()))
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
    tokens = sum(len(d.tokens) for d in data)

    print(f"== {model}")
    print(f"  load + create adapter  {load_s:8.2f} s")
    print(f"  peak GPU memory        {peak:8.1f} MiB")
    print(
        f"  forward_backward       median {statistics.median(fb_times) * 1e3:7.1f} ms "
        f"(first {fb_times[0] * 1e3:.1f} ms, {tokens} tokens)"
    )
    print(f"  optim_step             median {statistics.median(step_times) * 1e3:7.1f} ms")
    print(
        f"  sample 8 x 64          {sample_s:8.2f} s "
        f"({result.sample_tokens / sample_s:.0f} tokens/s)"
    )
    print(f"  max |sample lp - forward lp| {gap:.4f} (allowed {lp_tolerance})")
    print("  loss curve             " + " ".join(f"{x:.3f}" for x in losses))

    failures = []
    if not losses[-1] < 0.9 * losses[0]:
        failures.append(f"{model}: loss went {losses[0]:.3f} -> {losses[-1]:.3f}, not down 10%")
    if not gap <= lp_tolerance:
        failures.append(f"{model}: sample/forward logprob gap {gap:.4f} > {lp_tolerance}")
    engine.drop_adapter(model)
    return failures


def check_determinism(engine: Engine, model: str, steps: int) -> list[str]:
    """The same steps twice from the same seed: the state hashes after each step must be equal
    (what recovery, replay and fork compare). Prints and returns the failures."""
    learning_rate, _ = SETTINGS.get(model, ARCH_SETTINGS)
    mlp = "mlp" in engine.models(model).lora_targets
    spec = LoraSpec(rank=16, alpha=32, train_mlp=mlp, seed=1234)
    data = chat_data(engine, model)
    runs: list[list[dict[str, str]]] = []
    for run in range(2):
        adapter = f"{model}-determinism-{run}"
        engine.create_adapter(adapter, model, spec)
        hashes = []
        for _ in range(steps):
            engine.forward_backward(adapter, data, "cross_entropy")
            grads = engine.state_hashes(adapter, ["grads"])["grads"]
            engine.optim_step(adapter, AdamSpec(learning_rate=learning_rate))
            hashes.append({"grads": grads, **engine.state_hashes(adapter)})
        engine.drop_adapter(adapter)
        runs.append(hashes)
    for step, (first, second) in enumerate(zip(*runs, strict=True)):
        for part in first:
            if first[part] != second[part]:
                print(
                    f"  determinism            step {step}: {part} {first[part]} != {second[part]}"
                )
                return [f"{model}: two runs of the same steps differ at step {step} ({part})"]
    print(f"  determinism            {steps} steps x 2 runs: every state hash equal")
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: temp)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=[TINY_DEBUG_NAME, SMOLLM2_NAME])
    parser.add_argument(
        "--architectures", nargs="+", default=list(architectures.ARCHITECTURES),
        help="tiny random models of these architectures too ('none': no architecture)",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--determinism-steps", type=int, default=3, help="steps run twice and compared (0: skip)"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: CUDA is not available", file=sys.stderr)
        return 1
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {where}, torch {torch.__version__}")
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="treadle-cuda-check-"))
    names = [] if args.architectures == ["none"] else args.architectures
    registered = architecture_models(cache_dir / "architectures", names)
    engine = Engine(
        cache_dir=cache_dir,
        device=args.device,
        models=lambda name: registered.get(name) or get_base_model(name),
    )
    if args.device == "cuda" and engine.dtype != torch.bfloat16:
        print(f"FAIL: the CUDA engine runs {engine.dtype}, not bfloat16", file=sys.stderr)
        return 1
    if args.device == "cuda" and not torch.are_deterministic_algorithms_enabled():
        print("FAIL: the CUDA engine did not enable deterministic algorithms", file=sys.stderr)
        return 1
    print(f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}")
    failures: list[str] = []
    for model in [*args.models, *registered]:
        try:
            failures += check_model(engine, model, args.steps)
            if args.determinism_steps > 0:
                failures += check_determinism(engine, model, args.determinism_steps)
        except Exception:  # report and go on to the next model
            traceback.print_exc()
            failures.append(f"{model}: raised")
    for failure in failures:
        print("FAIL: " + failure, file=sys.stderr)
    print("OK" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
