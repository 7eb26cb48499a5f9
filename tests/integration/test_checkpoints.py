"""Checkpoints end to end: save, resume, registry, merged export, download and isolation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tinker import types

import treadle
from tests.integration.wire_client import WireClient
from treadle.client.checkpoints import CheckpointsClient

pytestmark = pytest.mark.integration

TOKENS = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282]


def _datum(tokens: list[int] = TOKENS) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _train(tc: treadle.TrainingClient, steps: int) -> None:
    for _ in range(steps):
        tc.forward_backward([_datum()], "cross_entropy")
        tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result()


def _weights(ckpts: CheckpointsClient, path: str, folder: Path) -> dict[str, np.ndarray]:
    ckpts.download(path, folder)
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def svc(platform):
    service = treadle.ServiceClient(base_url=platform.base_url, api_key=platform.admin_key)
    yield service
    service.close()


@pytest.fixture(scope="module")
def ckpts(platform) -> CheckpointsClient:
    return CheckpointsClient(platform.base_url, platform.admin_key)


def test_resume_with_optimizer_is_bit_identical(svc, ckpts, tmp_path: Path) -> None:
    tc = svc.create_lora_training_client(
        "treadle/tiny-debug", rank=4, seed=5, model_package_group="resume"
    )
    _train(tc, 3)
    saved = tc.save_state("step3").result().path
    assert saved == f"tinker://{tc.model_id}/weights/step3"
    _train(tc, 2)
    straight = tc.save_state("step5").result().path

    resumed = svc.create_training_client_from_state_with_optimizer(saved)
    _train(resumed, 2)
    again = resumed.save_state("step5-resumed").result().path
    a = _weights(ckpts, straight, tmp_path / "a")
    b = _weights(ckpts, again, tmp_path / "b")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    fresh = svc.create_training_client_from_state(saved)
    at_resume = _weights(ckpts, fresh.save_state("fresh0").result().path, tmp_path / "c")
    at_save = _weights(ckpts, saved, tmp_path / "d")
    assert all(np.array_equal(at_resume[k], at_save[k]) for k in at_save)
    _train(fresh, 2)  # a fresh optimizer takes different steps than the resumed one
    other = _weights(ckpts, fresh.save_state("fresh2").result().path, tmp_path / "e")
    assert any(not np.array_equal(other[k], b[k]) for k in b)

    versions = [c["version"] for c in ckpts.list(group="resume")]
    assert versions == sorted(versions) and len(versions) >= 3


def test_merged_export_loads_with_plain_transformers(svc, platform, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    tc = svc.create_lora_training_client("treadle/tiny-debug", rank=4, seed=6, alpha=8)
    _train(tc, 3)
    path = tc.save_weights_for_sampler("merged", merge_weights=True).result().path
    assert path.endswith("/sampler_weights/merged")
    env = {
        **os.environ,
        "TREADLE_BASE_URL": platform.base_url,
        "TREADLE_API_KEY": platform.admin_key,
    }
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "checkpoints", "download", path, str(tmp_path / "m")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "m"), torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS[:-1]])).logits[0].float()
    plain = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    live = tc.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert np.allclose(plain.numpy(), live, atol=1e-4)


def test_sampling_from_a_named_sampler_checkpoint(svc) -> None:
    tc = svc.create_lora_training_client("treadle/tiny-debug", rank=4, seed=7)
    _train(tc, 2)
    path = tc.save_weights_for_sampler("for-sampling").result().path
    live = tc.save_weights_and_get_sampling_client()
    saved = svc.create_sampling_client(path)
    params = treadle.SamplingParams(max_tokens=6, temperature=0.0)
    assert saved.sample(TOKENS[:4], 1, params).result().sequences[0].tokens == (
        live.sample(TOKENS[:4], 1, params).result().sequences[0].tokens
    )


@pytest.mark.parametrize("name", ["a/b", "..", "x..y", "nul\x00", "n" * 129])
def test_bad_checkpoint_names_are_400(platform, name: str) -> None:
    client = WireClient(platform.base_url, platform.admin_key)
    model_id = client.create_model()
    for route in ("save_weights", "save_weights_for_sampler"):
        r = client.post(route, {"model_id": model_id, "seq_id": 1, "path": name})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "name" in message or "path contains a NUL" in message


def test_another_tenant_cannot_see_load_or_download(svc, platform, tmp_path: Path) -> None:
    tc = svc.create_lora_training_client("treadle/tiny-debug", rank=4)
    path = tc.save_state("private").result().path
    admin = WireClient(platform.base_url, platform.admin_key)
    key = admin.post("treadle/tenants", {"id": "rival"}).json()["api_key"]
    other = CheckpointsClient(platform.base_url, key)
    assert other.list() == []
    with pytest.raises(RuntimeError, match="404"):
        other.get(path)
    with pytest.raises(RuntimeError, match="404"):
        other.download(path, tmp_path / "stolen")
    with pytest.raises(RuntimeError, match="404"):
        other.delete(path)
    rival = WireClient(platform.base_url, key)
    session = rival.post("create_session", {}).json()["session_id"]
    load = rival.post(
        "load_weights", {"session_id": session, "model_seq_id": 0, "path": path, "optimizer": True}
    )
    assert load.status_code == 404
    assert rival.post("weights_info", {"tinker_path": path}).status_code == 404
    assert (
        CheckpointsClient(platform.base_url, platform.admin_key).get(path)["checkpoint"][
            "tinker_path"
        ]
        == path
    )


def test_ttl_expires_a_checkpoint_and_its_files(svc, platform) -> None:
    import time

    tc = svc.create_lora_training_client("treadle/tiny-debug", rank=4)
    path = tc.save_state("short-lived", ttl_seconds=3600).result().path
    registry = svc.checkpoints
    assert registry.get(path)["checkpoint"]["expires_at"] is not None
    prefix = Path(platform.data_dir) / "storage"
    assert any(prefix.rglob("short-lived/*"))
    registry.set_ttl(path, 1)
    time.sleep(1.5)
    with pytest.raises(RuntimeError, match="404"):
        registry.get(path)
    deadline = time.monotonic() + 15  # the workers' keeper deletes the files
    while time.monotonic() < deadline and any(prefix.rglob("short-lived/*")):
        time.sleep(0.5)
    assert not any(prefix.rglob("short-lived/*"))


def test_cli_lists_sets_ttl_and_deletes(svc, platform) -> None:
    import json

    tc = svc.create_lora_training_client(
        "treadle/tiny-debug", rank=4, model_package_group="cli-group"
    )
    path = tc.save_state("via-cli").result().path
    env = {
        **os.environ,
        "TREADLE_BASE_URL": platform.base_url,
        "TREADLE_API_KEY": platform.admin_key,
    }

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "treadle.cli", "checkpoints", *args],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    listed = json.loads(cli("list", "--group", "cli-group").stdout)
    assert [c["tinker_path"] for c in listed] == [path] and listed[0]["version"] == 1
    assert json.loads(cli("ttl", path, "600").stdout)["expires_at"] is not None
    assert json.loads(cli("get", path).stdout)["files"]
    assert cli("delete", path).returncode == 0
    gone = cli("get", path)
    assert gone.returncode == 1 and "404" in gone.stderr
    assert json.loads(cli("list", "--group", "cli-group").stdout) == []


def test_saving_over_an_existing_name_needs_overwrite(platform) -> None:
    client = WireClient(platform.base_url, platform.admin_key)
    model_id = client.create_model()
    first = client.post("save_weights", {"model_id": model_id, "seq_id": 1, "path": "same"}).json()
    client.result(first["request_id"])
    again = client.post("save_weights", {"model_id": model_id, "seq_id": 2, "path": "same"})
    assert again.status_code == 400 and "overwrite" in again.json()["error"]["message"]
    forced = client.post(
        "save_weights", {"model_id": model_id, "seq_id": 2, "path": "same", "overwrite": True}
    ).json()
    assert client.result(forced["request_id"])["path"].endswith("/weights/same")
    listed = client.http.get(f"/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert [c["version"] for c in listed] == [2]  # the replaced version leaves the live list


def test_registry_speaks_the_tinker_rest_shape(svc, platform) -> None:
    import tinker

    tc = svc.create_lora_training_client("treadle/tiny-debug", rank=4, training_session_name="rest")
    path = tc.save_state("rest-a").result().path
    rest = tinker.RestClient(base_url=platform.base_url, api_key=platform.admin_key)
    run = rest.get_training_run(tc.model_id).result()
    assert run.training_run_id == tc.model_id and run.base_model == "treadle/tiny-debug"
    assert run.is_lora and run.lora_rank == 4
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == path
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in listed] == [
        ("weights/rest-a", "training")
    ]
    runs = rest.list_training_runs(limit=1000).result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.base_model == "treadle/tiny-debug" and info.is_lora
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


def test_load_state_into_a_live_session(svc, ckpts, tmp_path: Path) -> None:
    tc = svc.create_lora_training_client("treadle/tiny-debug", rank=4, seed=8)
    _train(tc, 2)
    saved = tc.save_state("two").result().path
    _train(tc, 2)  # move away, then come back
    tc.load_state_with_optimizer(saved).result()
    back = _weights(ckpts, tc.save_state("back").result().path, tmp_path / "back")
    original = _weights(ckpts, saved, tmp_path / "orig")
    assert all(np.array_equal(back[k], original[k]) for k in original)
