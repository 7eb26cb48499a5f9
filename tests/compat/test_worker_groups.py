"""Sessions on a worker group (`treadle up --devices 2`: one worker, two gloo ranks), in both
layouts: replicated (requests split into parts across the ranks, sample requests decoded by one
rank each) and sharded (each decoder layer's weights split across the ranks with FSDP2). Through
the plain tinker SDK, a fixed loop of cross_entropy and ppo with optimizer steps, then samples
and a saved state, ends with the per-datum logprobs and losses, and the adapter and Adam state
hashes the platform recorded, equal bit for bit to one process running the same loop (the
engine in this test's process, the same part size), and the same sampled tokens. `kill -9` of
rank 1 during forward_backward, and of rank 0 during optim_step: the loop finishes with no
client error and the same hashes; no rank process is left behind. `treadle status` shows the
group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import tinker
from tinker import types

from tests.fault.conftest import Up, start_up, wait_for
from tests.unit.engine_support import shared_cache_dir
from treadle.client.admin import AdminClient
from treadle.engine import AdamSpec, Engine, EngineDatum, LoraSpec, SamplingSpec
from treadle.platform.eventlog.schema import operations, usage
from treadle.platform.models.catalog import TINY_DEBUG_NAME

pytestmark = [pytest.mark.integration, pytest.mark.own_services]

PART_TOKENS = 96
STEPS = 6
LR = 1e-2
SEED = 5
RANK = 4
LENGTHS = (40, 9, 33, 17, 60, 25)  # four parts of at most 96 padded tokens
PROMPTS = ((5, 6, 7, 8), (9, 10, 11))  # sampled together: a rank each when replicated
SAMPLES = 3
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["replicated", "sharded"])
def group_up(request: pytest.FixtureRequest) -> Iterator[Up]:
    env = {
        "TREADLE_MICROBATCH_TOKENS": str(PART_TOKENS),
        "TREADLE_GROUP_TIMEOUT_SECONDS": "30",
        "TREADLE_GROUP_LAYOUT": request.param,
    }
    with start_up(workers=1, devices=2, env=env) as up:
        yield up


def data_of(step: int) -> tuple[str, list[dict[str, Any]]]:
    """Step `step`'s loss and data, as plain lists (the same for the SDK and the engine)."""
    loss = "ppo" if step % 3 == 2 else "cross_entropy"
    out = []
    for i, n in enumerate(LENGTHS):
        rng = np.random.default_rng(100 * step + i)
        tokens = [int(t) for t in rng.integers(1, 49_000, n + 1)]
        inputs: dict[str, list[Any]] = {"target_tokens": tokens[1:]}
        if loss == "ppo":
            inputs["logprobs"] = [-3.0] * n
            inputs["advantages"] = [float(a) for a in rng.normal(size=n).astype(np.float32)]
        else:
            inputs["weights"] = [1.0] * n
        out.append({"tokens": tokens[:-1], "inputs": inputs})
    return loss, out


def one_process(cache_dir: Path) -> dict[str, Any]:
    """The loop on an engine in this process: per step, the outputs and the hashes; then each
    prompt's samples."""
    engine = Engine(cache_dir=cache_dir, device="cpu", microbatch_tokens=PART_TOKENS)
    engine.create_adapter("a", TINY_DEBUG_NAME, LoraSpec(rank=RANK, alpha=32.0, seed=SEED))
    steps = []
    for step in range(STEPS):
        loss, data = data_of(step)
        batch = [
            EngineDatum(
                tokens=tuple(d["tokens"]),
                loss_fn_inputs={
                    k: np.asarray(v, np.int64 if k == "target_tokens" else np.float32)
                    for k, v in d["inputs"].items()
                },
            )
            for d in data
        ]
        out = engine.forward_backward("a", batch, loss)
        engine.optim_step("a", AdamSpec(learning_rate=LR))
        steps.append(
            {
                "logprobs": [o["logprobs"].tolist() for o in out.outputs],
                "losses": [o["elementwise_loss"].tolist() for o in out.outputs],
                "state": engine.state_hashes("a"),
            }
        )
    engine.snapshot("a", "final")
    samples = []
    for prompt in PROMPTS:
        spec = SamplingSpec(max_tokens=MAX_TOKENS, seed=SEED)
        result = engine.sample(TINY_DEBUG_NAME, "final", prompt, SAMPLES, spec)
        samples.append([[s.tokens, s.logprobs] for s in result.sequences])
    return {"steps": steps, "samples": samples}


def sdk_loop(
    up: Up, key: str, during: Any = None
) -> tuple[str, list[dict[str, Any]], list[list[Any]]]:
    """The loop through the tinker SDK; `during(step, op)` runs right after each
    forward_backward and optim_step is sent, before its result is awaited. Then the prompts
    sampled together from the trained weights, and the state saved."""
    service = tinker.ServiceClient(base_url=up.base_url, api_key=key)
    try:
        tc = service.create_lora_training_client(TINY_DEBUG_NAME, rank=RANK, seed=SEED).result()
        steps = []
        for step in range(STEPS):
            loss, data = data_of(step)
            batch = [
                types.Datum(
                    model_input=types.ModelInput.from_ints(d["tokens"]),
                    loss_fn_inputs=d["inputs"],
                )
                for d in data
            ]
            sent = tc.forward_backward(batch, loss)
            if during is not None:
                during(step, "forward_backward")
            out = sent.result()
            stepped = tc.optim_step(types.AdamParams(learning_rate=LR))
            if during is not None:
                during(step, "optim_step")
            stepped.result()
            steps.append(
                {
                    "logprobs": [o["logprobs"].tolist() for o in out.loss_fn_outputs],
                    "losses": [o["elementwise_loss"].tolist() for o in out.loss_fn_outputs],
                }
            )
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=MAX_TOKENS, seed=SEED)
        futures = [
            sampler.sample(types.ModelInput.from_ints(list(p)), SAMPLES, params) for p in PROMPTS
        ]
        samples = [[[s.tokens, s.logprobs] for s in f.result().sequences] for f in futures]
        tc.save_state("end").result()
        return tc.model_id, steps, samples
    finally:
        service.close("success").result()


def recorded_states(up: Up, model_id: str) -> list[dict[str, str]]:
    """The state hashes the platform recorded after each optim_step of the session."""
    with up.db.connect() as conn:
        rows = conn.execute(
            sa.select(operations.c.state)
            .where(operations.c.session_id == model_id, operations.c.type == "optim_step")
            .order_by(operations.c.seq_id)
        ).all()
    return [dict(r.state) for r in rows]


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return one_process(shared_cache_dir(tmp_path_factory))


def tenant_key(up: Up, tenant: str) -> str:
    """The API key of a new tenant of `up`."""
    admin = AdminClient(up.base_url, up.admin_key)
    try:
        return str(admin.create_tenant(tenant)["api_key"])
    finally:
        admin.close()


def live_worker(up: Up) -> dict[str, Any]:
    """The one live worker as `treadle status --json` shows it."""
    env = {**os.environ, "TREADLE_BASE_URL": up.base_url, "TREADLE_API_KEY": up.admin_key}
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "status", "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (worker,) = [w for w in json.loads(done.stdout)["workers"] if w["is_alive"]]
    return worker  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def key(group_up: Up) -> str:
    return tenant_key(group_up, "groups")


def rank_pids(up: Up) -> dict[int, int]:
    """RANK -> pid of the `treadle worker` rank processes of `up` (its data dir in their
    environment: another platform's group may run on this machine at the same time)."""
    data_dir = str(up.data_dir).encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"treadle.cli" in cmdline
            and b"worker" in cmdline
            and b"torch.distributed.run" not in cmdline
        ):
            env = dict(e.split(b"=", 1) for e in environ if b"=" in e)
            if b"RANK" in env and env.get(b"TREADLE_DATA_DIR") == data_dir:
                found[int(env[b"RANK"])] = int(proc.name)
    return found


def check_same(
    expected: dict[str, Any],
    steps: list[dict[str, Any]],
    states: list[dict[str, str]],
    samples: list[list[Any]],
) -> None:
    assert len(steps) == len(states) == STEPS
    for step, (want, got, state) in enumerate(zip(expected["steps"], steps, states, strict=True)):
        assert got["logprobs"] == want["logprobs"], f"step {step}"
        assert got["losses"] == want["losses"], f"step {step}"
        assert state == want["state"], f"step {step}"
    for want_p, got_p in zip(expected["samples"], samples, strict=True):
        assert [s[0] for s in got_p] == [s[0] for s in want_p]  # the same seed, the same tokens
        for (_, want_lp), (_, got_lp) in zip(want_p, got_p, strict=True):
            np.testing.assert_allclose(got_lp, want_lp, rtol=0, atol=1e-5)


def test_a_session_on_a_group_of_two_equals_one_process_bit_for_bit(
    group_up: Up, key: str, expected: dict[str, Any]
) -> None:
    model_id, steps, samples = sdk_loop(group_up, key)
    check_same(expected, steps, recorded_states(group_up, model_id), samples)


def test_status_and_metrics_show_the_group(group_up: Up, request: pytest.FixtureRequest) -> None:
    layout = request.node.callspec.params["group_up"]
    worker = live_worker(group_up)
    assert (worker["world_size"], worker["layout"]) == (2, layout)
    metrics = httpx.get(worker["metrics_url"], timeout=10).text
    ranks = f'treadle_group_ranks{{layout="{layout}",worker="{worker["id"]}"}} 2.0'
    assert ranks in metrics.splitlines(), metrics


@pytest.mark.parametrize(("rank", "op"), [(1, "forward_backward"), (0, "optim_step")])
def test_kill_9_of_a_rank_ends_the_group_and_the_loop_goes_on_to_the_same_weights(
    group_up: Up, key: str, expected: dict[str, Any], rank: int, op: str
) -> None:
    wait_for(lambda: sorted(rank_pids(group_up)) == [0, 1], 60, "a group of two ranks")
    before = rank_pids(group_up)

    def kill(step: int, sent: str) -> None:
        if (step, sent) == (2, op):
            os.kill(before[rank], signal.SIGKILL)

    model_id, steps, samples = sdk_loop(group_up, key, during=kill)
    check_same(expected, steps, recorded_states(group_up, model_id), samples)
    # a new group, and nothing of the old one left
    wait_for(lambda: sorted(rank_pids(group_up)) == [0, 1], 60, "a new group of two ranks")
    after = rank_pids(group_up)
    assert not set(before.values()) & set(after.values())
    for pid in before.values():
        assert (
            not Path(f"/proc/{pid}").exists()
            or b"Z" in Path(f"/proc/{pid}/stat").read_bytes().split(b")")[-1][:3]
        )


def test_replay_and_fork_of_a_group_session_are_verified_and_it_is_metered_once(
    group_up: Up, key: str, expected: dict[str, Any]
) -> None:
    import treadle

    model_id, _, samples = sdk_loop(group_up, key)
    svc = treadle.ServiceClient(base_url=group_up.base_url, api_key=key)
    try:
        report = svc.replay(model_id).report
        assert report.matched, str(report)
        assert report.verified >= 2 * STEPS  # every forward_backward and optim_step
        with group_up.db.connect() as conn:
            last = conn.execute(
                sa.select(sa.func.max(operations.c.seq_id)).where(
                    operations.c.session_id == model_id
                )
            ).scalar_one()
        fork = svc.fork_training_client(model_id, last)
        with group_up.db.connect() as conn:
            forked = conn.execute(
                sa.select(operations.c.result).where(
                    operations.c.session_id == fork.model_id, operations.c.seq_id == 0
                )
            ).scalar_one()
        assert forked is not None  # the fork's rebuild completed
    finally:
        svc.close()
    with group_up.db.connect() as conn:
        train, prefill, sampled = conn.execute(
            sa.select(
                sa.func.sum(usage.c.train_tokens),
                sa.func.sum(usage.c.prefill_tokens),
                sa.func.sum(usage.c.sample_tokens),
            ).where(usage.c.session_id == model_id)
        ).one()
    assert train == STEPS * sum(LENGTHS)  # each datum's tokens once, not once per rank
    # each sample request once, whichever rank decoded it
    assert prefill == sum(len(p) for p in PROMPTS)
    assert sampled == sum(len(s[0]) for request in samples for s in request)
