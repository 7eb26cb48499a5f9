"""Admission by size: a worker reports in its heartbeat which base models it can load (files
here, weights within its memory budget, TREADLE_WORKER_MODEL_MEMORY), sessions are placed only on
such workers, and a model no live worker can hold is refused at create_model with a 400 that
names the model, the worker and what is missing. `treadle status` shows each model's parameters,
bytes and hosts. A platform of its own whose one worker has 1 MiB for base models: the tiny
registered Qwen3 (under 0.3 MiB) fits, the built-in tiny-debug (13.5 MiB in float32) does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import tinker
from tinker import types

from tests import tiny_models
from tests.fault.conftest import Up, start_up
from treadle.client.admin import AdminClient

pytestmark = pytest.mark.integration

BUDGET = 2**20


@pytest.fixture(scope="module")
def small_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, str]]:
    folder = tiny_models.model_folder("qwen3", tmp_path_factory.mktemp("model") / "qwen3")
    with start_up(workers=1, env={"TREADLE_WORKER_MODEL_MEMORY": str(BUDGET)}) as up:
        admin = AdminClient(up.base_url, up.admin_key)
        try:
            admin.register_model("small/qwen3", path=str(folder))
            key = str(admin.create_tenant("sized")["api_key"])
        finally:
            admin.close()
        yield up, key


def test_a_model_no_live_worker_can_hold_is_refused_naming_what_is_missing(
    small_up: tuple[Up, str],
) -> None:
    up, key = small_up
    service = tinker.ServiceClient(base_url=up.base_url, api_key=key)
    try:
        with pytest.raises(tinker.BadRequestError) as info:
            service.create_lora_training_client("treadle/tiny-debug", rank=4).result()
        message = str(info.value)
        assert "no live worker can hold base model treadle/tiny-debug" in message
        assert "3,219,776 parameters" in message and "1.00 MiB" in message
        tc = service.create_lora_training_client("small/qwen3", rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
        )
        out = tc.forward_backward([datum], "cross_entropy").result()
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 3
    finally:
        service.close("success").result()


def test_status_shows_each_models_size_and_hosts(small_up: tuple[Up, str]) -> None:
    up, _ = small_up
    env = {**os.environ, "TREADLE_BASE_URL": up.base_url, "TREADLE_API_KEY": up.admin_key}
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "status", "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    (worker,) = [w for w in body["workers"] if w["is_alive"]]
    models = {m["name"]: m for m in body["models"]}
    assert models["small/qwen3"]["hosts"] == [worker["id"]]
    assert models["small/qwen3"]["parameters"] > 0
    assert models["small/qwen3"]["size_bytes"] == 4 * models["small/qwen3"]["parameters"]
    assert models["treadle/tiny-debug"]["hosts"] == []
    assert worker["device"] == "cpu"
    text = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "status"],
        env=env, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "small/qwen3" in text and "3,219,776" in text
