"""The vLLM sampling backend through the unmodified tinker SDK against `treadle up` (one worker,
TREADLE_SAMPLER_BACKEND=vllm): its worker starts one vLLM server (`make vllm`'s environment) for
SmolLM2-135M-Instruct, shared by every test here. Several sessions' adapters are sampled
together; each sequence's logprobs and compute_logprobs are within 1e-4 of the trainer's forward
of the same tokens; the adapter after save_weights_and_get_sampling_client is the one sampled; a
sample finishes while the worker is inside a forward_backward's training call (the sampling
thread, worker/sampler_thread.py); a killed vLLM process is started again and its samples sent
again, with no error for the client; a streamed completion (the openai client) comes in pieces as
vLLM draws them; cookbook 0.6.1's math_rl and Treadle's own rl_math recipe
run to the end on it. A sharded worker group of two ranks samples with its rank 0's vLLM server,
beside its training calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import redis
import tinker
from tinker import types

from tests.compat import users
from tests.conftest import Platform, Services, new_tenant_key, served_platform
from tests.databases import private_database
from tests.vllm_env import vllm_python
from treadle.platform.models import catalog
from treadle.worker import faults

pytestmark = pytest.mark.vllm

SMOLLM2 = catalog.SMOLLM2_NAME
PROMPT = [1, 504, 3458, 314, 253, 1789, 30, 378]
TOLERANCE = 1e-4  # float32 through another engine's kernels (docs/design.md, "Sampling backends")


@pytest.fixture(scope="module")
def vllm_platform(
    services: Services, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    """A platform of its own (database and Redis database too: the run's other platform must
    not take its sessions) whose one worker samples with vLLM."""
    with vllm_served(services, tmp_path_factory, "treadle_vllm", 8) as platform:
        yield platform


@contextlib.contextmanager
def vllm_served(
    services: Services,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    redis_offset: int,
    *,
    devices: int = 1,
    env: dict[str, str] | None = None,
) -> Iterator[Platform]:
    """`treadle up` with one worker (a group of `devices` ranks) sampling with vLLM, on a
    database `name` and the Redis database `redis_offset` after the run's."""
    data_dir = tmp_path_factory.mktemp(name)
    base, _, number = services.redis_url.rpartition("/")
    redis_url = f"{base}/{(int(number or 0) + redis_offset) % 16}"
    full_env = {
        "TREADLE_SAMPLER_BACKEND": "vllm",
        "TREADLE_VLLM_PYTHON": vllm_python(),
        "TREADLE_VLLM_MAX_LORA_RANK": "16",
        "TREADLE_DEBUG_FAULTS": "1",  # a forward_backward held inside its passes (faults.py)
        # its own cache: the server's model folder, log and adapters under `data_dir`
        "TREADLE_CACHE_DIR": str(data_dir / "cache"),
        **(env or {}),
    }
    with (
        private_database(services.database_url, name) as database_url,
        served_platform(
            database_url, redis_url, data_dir, workers=1, devices=devices, env=full_env
        ) as platform,
    ):
        yield platform


def test_a_sharded_worker_group_samples_with_vllm_beside_its_training(
    services: Services, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A worker group's samples go to rank 0's vLLM server (its snapshots are whole there): two
    sessions' adapters together within tolerance of the group's own forward, and a sample that
    finishes while the group's forward_backward is held (rank 0 before it sends the call). Its
    platform, a sharded group of two ranks, lives for this test only, the module's first: no
    other vLLM server runs beside its own (two on this machine's two cores starved the tests
    beside them)."""
    sharded = {"TREADLE_GROUP_LAYOUT": "sharded"}
    with vllm_served(
        services, tmp_path_factory, "treadle_vllm_group", 9, devices=2, env=sharded
    ) as platform:
        service = tinker.ServiceClient(
            base_url=platform.base_url, api_key=new_tenant_key(platform, "vllm-group")
        )
        try:
            sample_together_within_tolerance(service)
            sample_while_a_forward_backward_is_held(platform, service)
        finally:
            service.close("success").result()
        assert sampled_by_vllm(platform) > 0
        assert len(vllm_server_pids(platform)) == 1  # rank 0's, the group's only one


@pytest.fixture(scope="module")
def key(vllm_platform: Platform) -> str:
    return new_tenant_key(vllm_platform, "vllm")


@pytest.fixture(scope="module")
def service(vllm_platform: Platform, key: str) -> Iterator[tinker.ServiceClient]:
    svc = tinker.ServiceClient(base_url=vllm_platform.base_url, api_key=key)
    yield svc
    svc.close("success").result()


def trained(service: tinker.ServiceClient, seed: int, steps: int = 1) -> tinker.TrainingClient:
    """A session whose adapter is no longer the base model (B != 0, lm_head included)."""
    tc = service.create_lora_training_client(SMOLLM2, rank=8, seed=seed).result()
    train(tc, seed, steps)
    return tc


def train(tc: tinker.TrainingClient, seed: int, steps: int) -> None:
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(100, 5000, size=12)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()


def forward_logprobs(tc: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    """The trainer's logprob of each of tokens[1:] given the ones before it."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    out = tc.forward([datum], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), np.float64)


def test_sessions_adapters_sample_together_within_tolerance_of_their_forward(
    service: tinker.ServiceClient,
) -> None:
    sample_together_within_tolerance(service)


def sample_together_within_tolerance(service: tinker.ServiceClient) -> None:
    """Two sessions' adapters sampled and scored at once, each within TOLERANCE of its own
    trainer's forward of the same tokens."""
    trainers = [trained(service, seed) for seed in (1, 2)]
    samplers = [tc.save_weights_and_get_sampling_client().result() for tc in trainers]
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    prompt = types.ModelInput.from_ints(PROMPT)
    # every request in flight at once: vLLM decodes them together, each with its adapter
    samples = [s.sample(prompt, 2, params) for s in samplers]
    scored = [s.compute_logprobs(prompt) for s in samplers]
    results = [f.result() for f in samples]
    prompt_logprobs = [f.result() for f in scored]
    for tc, result, scores in zip(trainers, results, prompt_logprobs, strict=True):
        assert len(result.sequences) == 2
        for sequence in result.sequences:
            assert sequence.logprobs is not None and len(sequence.tokens) >= 1
            expected = forward_logprobs(tc, PROMPT + sequence.tokens)[len(PROMPT) - 1 :]
            np.testing.assert_allclose(sequence.logprobs, expected, atol=TOLERANCE, rtol=0)
        assert scores[0] is None
        expected = forward_logprobs(tc, PROMPT)
        np.testing.assert_allclose(scores[1:], expected, atol=TOLERANCE, rtol=0)
    # the two adapters differ, and each request was served with its own
    a, b = (np.asarray(s[1:]) for s in prompt_logprobs)
    assert np.abs(a - b).max() > 1e-2


def test_the_adapter_after_save_weights_and_get_sampling_client_is_the_one_sampled(
    service: tinker.ServiceClient,
) -> None:
    """Each snapshot is served under a name of its own weights: a backend that loaded the new
    files under a reused name would serve the old weights, and this test would fail."""
    tc = trained(service, seed=3)
    prompt = types.ModelInput.from_ints(PROMPT)
    before = tc.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
    train(tc, seed=3, steps=2)
    after = tc.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
    expected = forward_logprobs(tc, PROMPT)
    np.testing.assert_allclose(after[1:], expected, atol=TOLERANCE, rtol=0)
    assert np.abs(np.asarray(before[1:]) - expected).max() > 10 * TOLERANCE


def test_a_sample_finishes_while_a_forward_backward_computes(
    vllm_platform: Platform, service: tinker.ServiceClient
) -> None:
    """The worker's one Celery thread is held inside a forward_backward's training call, the
    engine's lock held, before its first pass (`faults.IN_PASSES`): the session's sample, sent
    then, finishes on the sampling thread while the forward_backward is still held; on the
    reference loop it would wait for the whole call."""
    sample_while_a_forward_backward_is_held(vllm_platform, service)


def sample_while_a_forward_backward_is_held(
    platform: Platform, service: tinker.ServiceClient
) -> None:
    tc = trained(service, seed=7)
    sampler = tc.save_weights_and_get_sampling_client().result()
    pauses = redis.Redis.from_url(platform.redis_url)
    model_id = str(tc.model_id)
    faults.arm_pause(pauses, model_id, faults.IN_PASSES, 120.0)
    tokens = PROMPT + PROMPT
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    held = tc.forward_backward([datum], "cross_entropy")
    deadline = time.monotonic() + 60
    while pauses.get(faults.paused_key(model_id)) is None:
        assert time.monotonic() < deadline, "the forward_backward never reached its passes"
        time.sleep(0.1)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=9)
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result(timeout=60)
    assert len(result.sequences) == 2
    assert pauses.exists(faults.paused_key(model_id))  # still held: the sample did not wait
    faults.release(pauses, model_id)
    assert held.result(timeout=60).metrics["loss:sum"] > 0


def test_a_streamed_completion_comes_in_pieces_as_vllm_draws_them(
    vllm_platform: Platform, service: tinker.ServiceClient, key: str
) -> None:
    """Through the openai client: a streamed completion of the session's weights arrives in
    several chunks (one per step that drew tokens: vLLM's own stream, read as it comes) that add
    up to the unstreamed answer for the same seed."""
    tc = trained(service, seed=8)
    tc.save_weights_and_get_sampling_client().result()
    client = openai.OpenAI(base_url=f"{vllm_platform.base_url}/v1", api_key=key, max_retries=0)
    common: dict[str, Any] = {
        "model": tc.model_id,
        "prompt": "Count from one to twenty: one, two, three,",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 21,
    }
    whole = client.completions.create(**common)
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **common)
              if c.choices and c.choices[0].text]  # fmt: skip
    assert "".join(pieces) == whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens >= 4
    assert len(pieces) >= 3  # whole, it would come as one chunk at the end


def vllm_server_pids(platform: Platform) -> list[int]:
    """The vLLM API servers the platform's worker started (their command names its data)."""
    found = subprocess.run(
        ["pgrep", "-f", f"vllm.entrypoints.openai.api_server --model {platform.data_dir}"],
        capture_output=True,
        text=True,
    )
    return [int(pid) for pid in found.stdout.split()]


def test_a_killed_vllm_process_costs_the_client_no_error(
    vllm_platform: Platform, service: tinker.ServiceClient
) -> None:
    tc = trained(service, seed=4)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    first = sampler.sample(prompt, 2, params).result()
    (pid,) = vllm_server_pids(vllm_platform)
    os.killpg(pid, signal.SIGKILL)  # the server and its engine processes
    deadline = time.monotonic() + 30
    while vllm_server_pids(vllm_platform) == [pid] and time.monotonic() < deadline:
        time.sleep(0.2)
    again = sampler.sample(prompt, 2, params).result()  # no error reaches the client
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    assert len(vllm_server_pids(vllm_platform)) == 1  # a new one


def test_cookbook_math_rl_runs_to_the_end_on_vllm(vllm_platform: Platform, tmp_path: Path) -> None:
    tenant = f"vllm-math-{secrets.token_hex(3)}"
    key = new_tenant_key(vllm_platform, tenant)
    log = tmp_path / "math-rl"
    env = users.user_env(
        vllm_platform.base_url, key, tmp_path / "hf-home",
        TINKER_COOKBOOK_RUNS_DIR=str(tmp_path / "runs"),
        TREADLE_CACHE_DIR=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
    )  # fmt: skip
    done = subprocess.run(
        [
            sys.executable, "-m", "treadle.cookbook", "tinker_cookbook.recipes.math_rl.train",
            "env=arithmetic", f"model_name={SMOLLM2}", "lora_rank=4", "group_size=2",
            "groups_per_batch=2", "max_tokens=6", "eval_every=0", "save_every=0",
            "max_steps=2", f"log_path={log}", "behavior_if_log_dir_exists=delete",
        ],
        env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    steps = [line for line in (log / "metrics.jsonl").read_text().splitlines() if "reward" in line]
    assert len(steps) == 2
    assert sampled_by_vllm(vllm_platform) > 0


def sampled_by_vllm(platform: Platform) -> int:
    """Completions vLLM's server answered (its log), so the samples did not fall back."""
    logs = (platform.data_dir).rglob("vllm/*.log")
    return sum(p.read_text(errors="replace").count('"POST /v1/completions') for p in logs)


def test_the_rl_math_recipe_runs_to_the_end_on_vllm(
    vllm_platform: Platform, tmp_path: Path
) -> None:
    served = sampled_by_vllm(vllm_platform)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TINKER_", "TREADLE_", "HF_", "TRANSFORMERS_"))
    }
    done = subprocess.run(
        [
            sys.executable, "-m", "treadle.recipes.rl_math",
            "--base-url", vllm_platform.base_url, "--api-key", vllm_platform.admin_key,
            "--model", SMOLLM2, "--log-dir", str(tmp_path), "--no-progress",
            "--train-size", "8", "--questions", "2", "--group-size", "2", "--eval-size", "2",
            "--max-tokens", "6", "--steps", "2", "--eval-every", "0", "--save-every", "0",
        ],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]
    assert sampled_by_vllm(vllm_platform) > served
