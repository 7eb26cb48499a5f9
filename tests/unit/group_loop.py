"""One fixed training loop run on an engine, at any world size and layout: what tests/unit/
test_worker_group.py compares. Run as a module, it is one rank of a worker group (torchrun's
environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; GROUP_LOOP_LAYOUT replicated or
sharded; GROUP_LOOP_MODEL_FOLDER, a registrable model folder to run on instead of the built-in
tiny model: a sharded group then reads it from its files a layer at a time, where they allow,
`engine/models/weight_files.py`): rank 0 drives the loop through a `GroupExecutor` and writes
the result as JSON (with, sharded, the shape of the mesh a layer is sharded on and rank 0's rows
of the embeddings and head), the others
follow.

    python -m tests.unit.group_loop CACHE_DIR OUT.json [save|load FOLDER]
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from treadle.engine import (  # noqa: E402
    AdamSpec,
    Engine,
    EngineDatum,
    LoraSpec,
    SampleRequest,
    SamplingSpec,
)
from treadle.platform.models import model_files  # noqa: E402
from treadle.platform.models.catalog import TINY_DEBUG_NAME, BaseModelInfo  # noqa: E402

MICROBATCH_TOKENS = 96  # small parts, so a request splits across ranks
LORA = LoraSpec(rank=4, alpha=8.0, seed=7)
ADAM = AdamSpec(learning_rate=1e-2)
STEPS = 10


def registered(folder: Path) -> BaseModelInfo:
    """The registry entry of the model in `folder` (named `group-loop/model`)."""
    return model_files.inspect_folder("group-loop/model", folder, model_files.Options())


def datum(seed: int, n: int, rl: bool, vocab: int = 49_000) -> EngineDatum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, n + 1)
    inputs: dict[str, np.ndarray] = {"target_tokens": tokens[1:].astype(np.int64)}
    if rl:
        inputs["logprobs"] = np.full(n, -3.0, np.float32)
        inputs["advantages"] = rng.normal(size=n).astype(np.float32)
    else:
        inputs["weights"] = np.ones(n, np.float32)
    return EngineDatum(tokens=tuple(int(t) for t in tokens[:-1]), loss_fn_inputs=inputs)


class StopAt:
    """A request's interrupt that stops it at its `n`th decoding step (as a client's cancel)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls >= self.n:
            raise RuntimeError(f"stopped at step {self.n}")


def sample_some(engine: Any, snapshot_id: str | None, model: str = TINY_DEBUG_NAME) -> list[Any]:
    """Four seeded requests in one batch (a rank each, in a group), one stopped at its third
    step: each one's tokens and logprobs, or its error."""
    requests = [
        SampleRequest(
            model,
            snapshot_id,
            prompt,
            n,
            SamplingSpec(max_tokens=6, seed=seed, stop=()),
            interrupt=StopAt(3) if seed == 4 else None,
        )
        for seed, (prompt, n) in enumerate(
            [((5, 6, 7, 8), 2), ((9, 10), 1), ((11, 12, 13), 3), ((14,) * 7, 2), ((3, 2), 1)]
        )
    ]
    out: list[Any] = []
    for result in engine.sample_batch(requests):
        if isinstance(result, Exception):
            out.append(str(result))
        else:
            out.append([[s.tokens, s.logprobs] for s in result.sequences])
    return out


def run_loop(
    engine: Any,
    load: Path | None = None,
    save: Path | None = None,
    model: BaseModelInfo | None = None,
) -> dict[str, Any]:
    """Ten steps of cross_entropy and ppo on six data of mixed lengths, an optimizer step each;
    every step's per-datum logprobs and losses and the state hashes after it, and every third
    step samples from a snapshot of the adapter (and once from the base model alone). With
    `load`, the adapter starts from that export (weights and Adam state); with `save`, it is
    exported after five steps. On `model` (a registered one) instead of the built-in one if
    given, its every LoRA target adapted."""
    name = TINY_DEBUG_NAME if model is None else model.name
    vocab = 49_000 if model is None else model.vocab_size
    if load is None:
        engine.create_adapter("a", name, LORA)
    else:
        engine.import_adapter("a", name, load, with_optimizer=True)
    steps = []
    samples = [sample_some(engine, None, name)]
    first = 0 if load is None else STEPS // 2
    for step in range(first, STEPS):
        loss = "ppo" if step % 3 == 2 else "cross_entropy"
        data = [
            datum(100 * step + i, n, loss == "ppo", vocab)
            for i, n in enumerate((40, 9, 33, 17, 60, 25))
        ]
        out = engine.forward_backward("a", data, loss)
        metrics = engine.optim_step("a", ADAM)
        steps.append(
            {
                "logprobs": [o["logprobs"].tolist() for o in out.outputs],
                "losses": [o["elementwise_loss"].tolist() for o in out.outputs],
                "loss": out.metrics["loss:sum"],
                "grad_norm": metrics["grad_norm:mean"],
                "state": engine.state_hashes("a"),
            }
        )
        if step % 3 == 0:
            engine.snapshot("a", f"s{step}")
            samples.append(sample_some(engine, f"s{step}", name))
        if save is not None and step == STEPS // 2 - 1:
            engine.export_adapter("a", save, with_optimizer=True)
    return {"steps": steps, "samples": samples, "weight_hash": engine.weight_hash("a")}


def broken_sampling(engine: Any) -> dict[str, Any]:
    """Sample while rank 1 cannot (its engine fails to open a batch), then train a step: what
    the batch raised, and whether the group went on."""
    engine.create_adapter("a", TINY_DEBUG_NAME, LORA)
    try:
        sample_some(engine, None)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    engine.forward_backward("a", [datum(1, 40, False)], "cross_entropy")
    engine.optim_step("a", ADAM)
    return {"error": error, "weight_hash": engine.weight_hash("a")}


def sample_first(engine: Any) -> dict[str, Any]:
    """The base model's first use a sample (no adapter on it yet), then a training step: what
    was sampled and the weights after."""
    samples = sample_some(engine, None)
    engine.create_adapter("a", TINY_DEBUG_NAME, LORA)
    engine.forward_backward("a", [datum(1, 40, False)], "cross_entropy")
    engine.optim_step("a", ADAM)
    return {"samples": samples, "weight_hash": engine.weight_hash("a")}


def main() -> None:
    from treadle.engine import GroupExecutor, follow
    from treadle.engine.distributed import group as worker_group

    cache_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    mode, folder = (sys.argv[3], Path(sys.argv[4])) if len(sys.argv) > 4 else ("", None)
    layout = os.environ.get("GROUP_LOOP_LAYOUT", "replicated")
    g = worker_group.init_from_env(timeout_seconds=120, device="cpu", layout=layout)
    folder_env = os.environ.get("GROUP_LOOP_MODEL_FOLDER")
    model = registered(Path(folder_env)) if folder_env else None
    tokens = MICROBATCH_TOKENS
    if g.rank == 1 and os.environ.get("GROUP_LOOP_RANK1_TOKENS"):  # configured otherwise
        tokens = int(os.environ["GROUP_LOOP_RANK1_TOKENS"])
    engine = Engine(
        cache_dir=cache_dir,
        device="cpu",
        parallel=g,
        microbatch_tokens=tokens,
        **({} if model is None else {"models": {model.name: model}.__getitem__}),
    )
    if g.rank == 1 and os.environ.get("GROUP_LOOP_DRIFT"):  # a rank whose steps go elsewhere
        step = engine.optim_step
        engine.optim_step = lambda adapter_id, adam: step(  # type: ignore[method-assign]
            adapter_id, dataclasses.replace(adam, learning_rate=2 * adam.learning_rate)
        )
    broken = bool(os.environ.get("GROUP_LOOP_BREAK_SAMPLING"))
    if g.rank == 1 and broken:

        def cannot_open(base_model: str) -> Any:
            raise RuntimeError("no batch on rank 1")

        engine.open_batch = cannot_open  # type: ignore[method-assign]
    if g.is_leader:
        leader = GroupExecutor(engine, g)
        try:
            if broken:
                result = broken_sampling(leader)
            elif os.environ.get("GROUP_LOOP_SAMPLE_FIRST"):
                result = sample_first(leader)
            else:
                result = run_loop(
                    leader,
                    load=folder if mode == "load" else None,
                    save=folder if mode == "save" else None,
                    model=model,
                )
            if layout == "sharded":  # how rank 0 holds a layer's weights
                base = engine._bases[TINY_DEBUG_NAME if model is None else model.name]
                layer = base.model.get_decoder().layers[0]
                result["mesh"] = list(next(layer.parameters()).device_mesh.shape)
                # and its rows of the embeddings and head (`distributed.vocabulary`), if untied
                held = base.model.get_input_embeddings(), base.model.get_output_embeddings()
                result["vocabulary_rows"] = [
                    int(m.rows.shape[0]) if hasattr(m, "vocab_rows") else None
                    for m in (held[0], getattr(held[1], "base", held[1]))
                ]
        finally:
            leader.close()
        out.write_text(json.dumps(result))
    else:
        follow(engine, g)
        worker_group.leave(engine)  # rank 0's close() left already


if __name__ == "__main__":
    main()
