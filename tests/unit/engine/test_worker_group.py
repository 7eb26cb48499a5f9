"""A worker group of two gloo ranks runs a fixed loop (cross_entropy and ppo, ten optimizer
steps, each request split into parts across the ranks) to the same per-datum logprobs and
losses, the same adapter and optimizer state hashes, bit for bit, as one process; a state
exported by the group loads in one process (and one process's in the group) and continues to
the same weights as an uninterrupted run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests import tiny_models
from tests.unit import group_loop
from tests.unit.engine_support import shared_cache_dir
from treadle.engine import Engine
from treadle.engine.distributed.group import Group
from treadle.engine.memory.capacity import HEADROOM, Capacity
from treadle.platform.config import PlatformConfig
from treadle.platform.embedded import free_port
from treadle.platform.models.catalog import TINY_DEBUG_NAME, get_base_model

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_cache_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def alone(cache_dir: Path) -> dict[str, Any]:
    """The loop in one process, as every group of the plain loop must end (run once)."""
    return one_process(cache_dir)


def one_process(cache_dir: Path, model_folder: Path | None = None, **kwargs: Any) -> dict[str, Any]:
    model = None if model_folder is None else group_loop.registered(model_folder)
    engine = Engine(
        cache_dir=cache_dir,
        device="cpu",
        microbatch_tokens=group_loop.MICROBATCH_TOKENS,
        **({} if model is None else {"models": {model.name: model}.__getitem__}),
    )
    return group_loop.run_loop(engine, model=model, **kwargs)


def run_ranks(
    cache_dir: Path,
    out: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    world_size: int = 2,
    node_size: int | None = None,
) -> tuple[list[int], str]:
    """The loop on a group of `world_size` ranks (two by default), each a process with
    torchrun's environment, as if `node_size` of them ran on each host (all on one by
    default): their exit statuses and output."""
    port = str(free_port())
    node_size = node_size or world_size
    procs = []
    for rank in range(world_size):
        rank_env = {**os.environ, **(env or {}), "RANK": str(rank),
                    "LOCAL_RANK": str(rank % node_size), "LOCAL_WORLD_SIZE": str(node_size),
                    "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.unit.group_loop", str(cache_dir), str(out), *extra],
            cwd=ROOT, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))  # fmt: skip
    logs = [p.communicate(timeout=300)[0] for p in procs]
    return [p.returncode for p in procs], "\n".join(logs)


def group_of_two(
    cache_dir: Path,
    out: Path,
    *extra: str,
    layout: str = "replicated",
    model_folder: Path | None = None,
) -> dict[str, Any]:
    env = {"GROUP_LOOP_LAYOUT": layout}
    if model_folder is not None:
        env["GROUP_LOOP_MODEL_FOLDER"] = str(model_folder)
    codes, logs = run_ranks(cache_dir, out, *extra, env=env)
    assert codes == [0, 0], logs[-6000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def same_samples(alone: list[Any], grouped: list[Any]) -> None:
    """The same tokens (the same seeds) and errors; logprobs within float32 rounding (a
    request decoded among other neighbours than in one process)."""
    assert len(alone) == len(grouped)
    for a_batch, g_batch in zip(alone, grouped, strict=True):
        for a, g in zip(a_batch, g_batch, strict=True):
            if isinstance(a, str):
                assert a == g
                continue
            assert [s[0] for s in a] == [s[0] for s in g]
            for (_, a_lp), (_, g_lp) in zip(a, g, strict=True):
                np.testing.assert_allclose(a_lp, g_lp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_two_ranks_equal_one_process_bit_for_bit(
    cache_dir: Path, alone: dict[str, Any], tmp_path: Path, layout: str
) -> None:
    """Replicated: each rank computes its share of every request's parts and decodes its
    share of the sample requests. Sharded: each rank holds half of every decoder layer's
    weights (FSDP2), gathered for each pass."""
    grouped = group_of_two(cache_dir, tmp_path / "out.json", layout=layout)
    assert len(grouped["steps"]) == group_loop.STEPS
    for step, (a, b) in enumerate(zip(alone["steps"], grouped["steps"], strict=True)):
        assert a["state"] == b["state"], f"step {step}"
        assert a["logprobs"] == b["logprobs"] and a["losses"] == b["losses"], f"step {step}"
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], f"step {step}"
    assert alone["weight_hash"] == grouped["weight_hash"]
    same_samples(alone["samples"], grouped["samples"])
    assert any(isinstance(r, str) and "stopped at step 3" in r for r in grouped["samples"][0])


def test_a_group_on_two_hosts_shards_within_each_and_equals_one_process_bit_for_bit(
    cache_dir: Path, tmp_path: Path
) -> None:
    """Hybrid sharding: four ranks as two hosts of two (torchrun's LOCAL_WORLD_SIZE), each
    host's ranks sharding a whole copy of every decoder layer, and of the (untied) embeddings
    and head by vocabulary rows, between them."""
    folder = tiny_models.model_folder("llama3", tmp_path / "model")
    alone = one_process(cache_dir, folder)
    out = tmp_path / "out.json"
    env = {"GROUP_LOOP_LAYOUT": "sharded", "GROUP_LOOP_MODEL_FOLDER": str(folder)}
    codes, logs = run_ranks(cache_dir, out, env=env, world_size=4, node_size=2)
    assert codes == [0] * 4, logs[-6000:]
    grouped = json.loads(out.read_text())
    assert grouped["mesh"] == [2, 2]  # two hosts, each layer split between a host's two ranks
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert grouped["vocabulary_rows"] == [-(-vocab // 2)] * 2  # half of each, within a host
    for step, (a, b) in enumerate(zip(alone["steps"], grouped["steps"], strict=True)):
        assert a["state"] == b["state"], f"step {step}"
        assert a["logprobs"] == b["logprobs"] and a["losses"] == b["losses"], f"step {step}"
    assert alone["weight_hash"] == grouped["weight_hash"]
    same_samples(alone["samples"], grouped["samples"])


def test_a_group_whose_ranks_do_not_split_into_equal_hosts_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be split into hosts of 2"):
        Group(0, 3, 60.0, "sharded", node_size=2)


def test_a_sharded_group_reading_its_model_a_layer_at_a_time_equals_one_process(
    cache_dir: Path, tmp_path: Path
) -> None:
    """A registered model: each rank builds it on the meta device and reads its decoder layers
    from the safetensors file one at a time, keeping its shards; one process loads it whole."""
    folder = tiny_models.model_folder("llama3", tmp_path / "model")
    alone = one_process(cache_dir, folder)
    grouped = group_of_two(cache_dir, tmp_path / "out.json", layout="sharded", model_folder=folder)
    assert grouped["mesh"] == [2]
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert grouped["vocabulary_rows"] == [-(-vocab // 2)] * 2  # its rows alone, read alone
    for step, (a, b) in enumerate(zip(alone["steps"], grouped["steps"], strict=True)):
        assert a["state"] == b["state"], f"step {step}"
        assert a["logprobs"] == b["logprobs"] and a["losses"] == b["losses"], f"step {step}"
    assert alone["weight_hash"] == grouped["weight_hash"]
    same_samples(alone["samples"], grouped["samples"])


def test_a_sharded_group_trains_moe_experts_as_one_process_does(
    cache_dir: Path, tmp_path: Path
) -> None:
    """Tiny Qwen3-MoE with every target adapted (its experts' 3-D parameters too): each rank
    holds half of every layer's experts (FSDP2 shards the stacks by expert), gathered for each
    pass, and the loop ends as in one process, bit for bit."""
    folder = tiny_models.model_folder("qwen3-moe", tmp_path / "qwen3-moe")
    assert group_loop.LORA.train_mlp and "mlp" in group_loop.registered(folder).lora_targets
    alone = one_process(cache_dir, folder)
    grouped = group_of_two(cache_dir, tmp_path / "out.json", layout="sharded", model_folder=folder)
    for step, (a, b) in enumerate(zip(alone["steps"], grouped["steps"], strict=True)):
        assert a["state"] == b["state"], f"step {step}"
        assert a["logprobs"] == b["logprobs"] and a["losses"] == b["losses"], f"step {step}"
    assert alone["weight_hash"] == grouped["weight_hash"]
    same_samples(alone["samples"], grouped["samples"])


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_a_state_saved_by_the_group_loads_in_one_process_and_back(
    cache_dir: Path, alone: dict[str, Any], tmp_path: Path, layout: str
) -> None:
    uninterrupted = alone
    saved_by_group = tmp_path / "by-group"
    group_of_two(cache_dir, tmp_path / "a.json", "save", str(saved_by_group), layout=layout)
    continued_alone = one_process(cache_dir, load=saved_by_group)
    assert continued_alone["weight_hash"] == uninterrupted["weight_hash"]

    saved_alone = tmp_path / "alone"
    one_process(cache_dir, save=saved_alone)
    continued_by_group = group_of_two(
        cache_dir, tmp_path / "b.json", "load", str(saved_alone), layout=layout
    )
    assert continued_by_group["weight_hash"] == uninterrupted["weight_hash"]
    assert continued_by_group["steps"][-1]["state"] == uninterrupted["steps"][-1]["state"]


def test_samples_are_decoded_on_every_rank_and_a_ranks_failure_fails_the_batch(
    cache_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 cannot open a sample batch: a batch of several requests fails with rank 1's
    error (so requests were handed to rank 1, not all decoded on rank 0), on every rank alike,
    and the group goes on training."""
    out = tmp_path / "out.json"
    codes, logs = run_ranks(cache_dir, out, env={"GROUP_LOOP_BREAK_SAMPLING": "1"})
    assert codes == [0, 0], logs[-6000:]
    result = json.loads(out.read_text())
    assert "rank 1: RuntimeError: no batch on rank 1" in result["error"]
    alone = Engine(cache_dir=cache_dir, device="cpu")
    assert result["weight_hash"] == group_loop.broken_sampling(alone)["weight_hash"]


def test_a_sharded_group_whose_first_call_is_a_sample_serves_it(
    cache_dir: Path, tmp_path: Path
) -> None:
    """Loading a base model shards it, a collective: a first sample on a base model no call
    has loaded yet loads it on every rank together (rank 0 alone there waited on the others'
    next call until the group's timeout, and the group crash-looped on the same request)."""
    out = tmp_path / "out.json"
    env = {"GROUP_LOOP_LAYOUT": "sharded", "GROUP_LOOP_SAMPLE_FIRST": "1"}
    codes, logs = run_ranks(cache_dir, out, env=env)
    assert codes == [0, 0], logs[-6000:]
    result = json.loads(out.read_text())
    alone = group_loop.sample_first(Engine(cache_dir=cache_dir, device="cpu"))
    same_samples([alone["samples"]], [result["samples"]])
    assert result["weight_hash"] == alone["weight_hash"]


def test_a_rank_configured_with_another_pass_budget_splits_as_rank_0_says(
    cache_dir: Path, alone: dict[str, Any], tmp_path: Path
) -> None:
    """Rank 1's engine is configured with a pass budget of 4,096 tokens (every request one
    pass), rank 0's with the loop's 96: rank 0 sends its budget with each forward_backward, so
    both cut every request the same way and the group equals one process at 96, bit for bit."""
    out = tmp_path / "out.json"
    codes, logs = run_ranks(cache_dir, out, env={"GROUP_LOOP_RANK1_TOKENS": "4096"})
    assert codes == [0, 0], logs[-6000:]
    grouped = json.loads(out.read_text())
    for step, (a, b) in enumerate(zip(alone["steps"], grouped["steps"], strict=True)):
        assert a["state"] == b["state"], f"step {step}"
    assert alone["weight_hash"] == grouped["weight_hash"]


def test_a_rank_whose_weights_drift_fails_the_group_instead_of_training_on(
    cache_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 steps with twice the learning rate: the ranks' weight hashes differ after the
    first optim_step, and every rank ends with the group-failed status (its launcher then ends
    the group and the worker is started again) before any other operation runs."""
    from treadle.engine.distributed.group import GROUP_FAILED_EXIT

    out = tmp_path / "out.json"
    codes, logs = run_ranks(cache_dir, out, env={"GROUP_LOOP_DRIFT": "1"})
    assert codes == [GROUP_FAILED_EXIT, GROUP_FAILED_EXIT], logs[-6000:]
    assert "disagree after optim_step" in logs
    assert not out.exists()  # rank 0 never finished the loop


@pytest.mark.parametrize("tokens_P", [[96, 40, 96], [10], [96, 96, 96, 96, 5], [50, 50]])
def test_every_rank_of_a_sharded_group_runs_as_many_passes(tokens_P: list[int]) -> None:
    """A sharded pass is a collective: ranks with fewer parts run extra, dropped passes on the
    smallest part; each part is kept by exactly one rank, the one `assign` gives it."""
    for layout in ("replicated", "sharded"):
        ranks = [Group(rank, 2, 60.0, layout) for rank in range(2)]
        passes = [g.passes(tokens_P) for g in ranks]
        kept = sorted(p for rank_passes in passes for p, keep in rank_passes if keep)
        assert kept == list(range(len(tokens_P)))
        for g, rank_passes in zip(ranks, passes, strict=True):
            assert [p for p, keep in rank_passes if keep] == g.assign(tokens_P)
        if layout == "sharded":
            assert len(passes[0]) == len(passes[1])
            smallest = min(range(len(tokens_P)), key=lambda p: tokens_P[p])
            assert all(p == smallest for r in passes for p, keep in r if not keep)
        else:
            assert all(keep for r in passes for _, keep in r)


def test_a_sharded_group_admits_a_model_by_its_share_per_rank() -> None:
    info = dataclasses.replace(get_base_model(TINY_DEBUG_NAME), parameters=1_000_000)
    needed = int(info.parameters * 4 * HEADROOM)  # float32 weights and a tenth more
    cpu = torch.device("cpu")
    assert Capacity(cpu, torch.float32, needed // 2, shards=2).refusal(info) is None
    refusal = Capacity(cpu, torch.float32, needed // 2 - 1024).refusal(info)
    assert refusal is not None and "per device" in refusal
    refusal = Capacity(cpu, torch.float32, needed // 4, shards=2).refusal(info)
    assert refusal is not None and "split across 2 ranks" in refusal


def test_an_unknown_layout_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="replicated, sharded"):
        Group(0, 2, 60.0, "striped")
    with pytest.raises(ValueError, match="TREADLE_GROUP_LAYOUT must be replicated or sharded"):
        PlatformConfig.from_env({"TREADLE_GROUP_LAYOUT": "striped"})
