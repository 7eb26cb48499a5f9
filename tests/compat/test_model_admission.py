"""Admission by size: a worker reports in its heartbeat which base models it can load (files
here, weights, a training pass and the sampler's KV budget within its memory budget,
TREADLE_WORKER_MODEL_MEMORY) and what each costs (its footprint); sessions are placed only on
workers with room for them beside the sessions they hold, a model no live worker can hold is
refused at create_model with a 400 that names the model, the worker and what is missing, and a
session no worker has room for with a 400 naming the numbers. `treadle status` shows each
model's parameters, bytes and hosts, and each worker's memory budget. A platform of its own
whose one worker has room for the tiny registered Qwen3 and two rank-4 adapters on it, not for
a rank-64 one, nor for the built-in tiny-debug (13.5 MiB of weights alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import tinker
import torch
from tinker import types

from tests import tiny_models
from tests.fault.conftest import Up, start_up, wait_for
from treadle.client.admin import AdminClient
from treadle.engine.footprint import PassSettings, model_footprint
from treadle.platform.models import model_files
from treadle.platform.sessions import admission

pytestmark = [pytest.mark.integration, pytest.mark.own_services]

# A pass of at most the model's 512-token context, 1,024 tokens of KV: the fixed part is small,
# so what the adapters take decides.
ENV = {
    "TREADLE_MICROBATCH_TOKENS": "512",
    "TREADLE_SAMPLER_KV_TOKENS": "1024",
    "TREADLE_ACTIVATION_CHECKPOINTING": "off",
}


def _rank(n: int) -> dict[str, Any]:
    return {"rank": n, "alpha": 32.0}


def _budget(folder: Path) -> tuple[int, dict[str, Any]]:
    """Room for the model and two rank-4 sessions (64 KiB more), computed as the worker will:
    the footprint from the same settings, added up by admission."""
    info = model_files.inspect_folder("small/qwen3", folder, model_files.Options())
    settings = PassSettings(
        torch.device("cpu"), torch.float32, microbatch_tokens=512, sampler_kv_tokens=1024,
        checkpointing=False,
    )  # fmt: skip
    fp = model_footprint(info, settings, Path(tempfile.gettempdir())).as_dict()
    worker = {"budget": {"capacity_bytes": 0}, "footprints": {"small/qwen3": fp}}
    held = [admission.Held(f"s{i}", "small/qwen3", "training", _rank(4)) for i in range(2)]
    used = admission.budget("w", worker, held)
    assert used is not None
    return used.used_bytes + 2**16, fp


@pytest.fixture(scope="module")
def small_up(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Up, str, int, dict[str, Any]]]:
    folder = tiny_models.model_folder("qwen3", tmp_path_factory.mktemp("model") / "qwen3")
    budget, fp = _budget(folder)
    with start_up(workers=1, env={**ENV, "TREADLE_WORKER_MODEL_MEMORY": str(budget)}) as up:
        admin = AdminClient(up.base_url, up.admin_key)
        try:
            admin.register_model("small/qwen3", path=str(folder))
            key = str(admin.create_tenant("sized")["api_key"])
        finally:
            admin.close()
        wait_for(lambda: _footprints(up) >= {"small/qwen3", "treadle/tiny-debug"}, 60,
                 "the worker's footprints")  # fmt: skip
        yield up, key, budget, fp


def _footprints(up: Up) -> set[str]:
    with up.db.connect() as conn:
        infos = conn.execute(sa.text("SELECT info FROM workers")).scalars().all()
    return {name for info in infos for name in (info.get("footprints") or {})}


def _status(up: Up, *args: str) -> str:
    env = {**os.environ, "TREADLE_BASE_URL": up.base_url, "TREADLE_API_KEY": up.admin_key}
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "status", *args],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_model_no_live_worker_can_hold_is_refused_naming_what_is_missing(
    small_up: tuple[Up, str, int, dict[str, Any]],
) -> None:
    up, key, budget, _ = small_up
    service = tinker.ServiceClient(base_url=up.base_url, api_key=key)
    try:
        with pytest.raises(tinker.BadRequestError) as info:
            service.create_lora_training_client("treadle/tiny-debug", rank=4).result()
        message = str(info.value)
        assert "no live worker can hold base model treadle/tiny-debug" in message
        assert "3,219,776 parameters" in message
        assert f"this worker has {budget / 2**20:.2f} MiB" in message
    finally:
        service.close("success").result()


def test_a_session_no_worker_has_room_for_is_refused_with_the_numbers_and_one_that_fits_trains(
    small_up: tuple[Up, str, int, dict[str, Any]],
) -> None:
    up, key, budget, fp = small_up
    service = tinker.ServiceClient(base_url=up.base_url, api_key=key)
    try:
        first = service.create_lora_training_client("small/qwen3", rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
        )
        out = first.forward_backward([datum], "cross_entropy").result()
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 3
        with pytest.raises(tinker.BadRequestError) as refused:
            service.create_lora_training_client("small/qwen3", rank=64).result()
        message = str(refused.value)
        n = admission.lora_parameters(fp, _rank(64))
        assert "no live worker has the memory for a rank-64 LoRA session on small/qwen3" in message
        assert f"({n:,} LoRA parameters x 16 bytes = " in message
        assert f"has {admission.size(budget)} per device: " in message
        assert "held by base models (small/qwen3)" in message
        assert "by 1 resident adapters of 1 sessions" in message
        assert "Lower the rank, train fewer targets" in message
        # the refusal changed nothing: a second rank-4 session fits and trains
        second = service.create_lora_training_client("small/qwen3", rank=4).result()
        assert len(second.forward_backward([datum], "cross_entropy").result().loss_fn_outputs) == 1
        body = json.loads(_status(up, "--json"))
        (worker,) = [w for w in body["workers"] if w["is_alive"]]
        memory = worker["memory"]
        assert memory["capacity_bytes"] == budget
        assert memory["base_bytes"] == fp["weight_bytes"]
        assert memory["sessions"] == 2
        assert memory["session_bytes"] == 2 * 16 * admission.lora_parameters(fp, _rank(4))
        assert 0 <= memory["free_bytes"] < 2**16 + 1
        text = _status(up)
        assert "Memory per device" in text and f"{budget / 2**20:,.1f} MiB" in text
    finally:
        service.close("success").result()


def test_status_shows_each_models_size_and_hosts(
    small_up: tuple[Up, str, int, dict[str, Any]],
) -> None:
    up, *_ = small_up
    body = json.loads(_status(up, "--json"))
    (worker,) = [w for w in body["workers"] if w["is_alive"]]
    models = {m["name"]: m for m in body["models"]}
    assert models["small/qwen3"]["hosts"] == [worker["id"]]
    assert models["small/qwen3"]["parameters"] > 0
    assert models["small/qwen3"]["size_bytes"] == 4 * models["small/qwen3"]["parameters"]
    assert models["treadle/tiny-debug"]["hosts"] == []
    assert worker["device"] == "cpu"
    text = _status(up)
    assert "small/qwen3" in text and "3,219,776" in text
