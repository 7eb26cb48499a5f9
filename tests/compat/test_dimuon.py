"""Dimuon through the unmodified tinker SDK against the served platform (`treadle up`, real
workers): a training client created with `optimizer=DimuonOptimizerConfig()` steps with
`DimuonParams`, resumes from `save_state` bit for bit against the uninterrupted run (weights and
momentum), replays and forks verified from its log; a step or a load of the other optimizer is a
400 that records nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

import treadle
from tests.conftest import Platform
from treadle.client.admin import AdminClient
from treadle.platform import db

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
DIMUON = types.DimuonParams(learning_rate=0.02, beta1=0.8, grad_clip_norm=1.0)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _step(tc: tinker.TrainingClient, step: int, params: types.OptimParams = DIMUON) -> None:
    batch = [_datum([1 + step, 7, 3, 9, 4]), _datum([2, 8 + step, 5])]
    fb = tc.forward_backward(batch, "cross_entropy")
    optim = tc.optim_step(params)
    fb.result()
    optim.result()


@dataclass(frozen=True)
class Tenant:
    platform: Platform
    key: str
    svc: tinker.ServiceClient
    treadle: treadle.ServiceClient
    db: sa.Engine

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.platform.base_url, headers={"X-API-Key": self.key}, timeout=60
        )

    def tensors(self, path: str, folder: Path) -> dict[str, torch.Tensor]:
        """Every tensor of a training checkpoint: adapter weights and optimizer state."""
        self.treadle.checkpoints.download(path, folder)
        return {
            f"{f.name}:{name}": tensor
            for f in sorted(folder.glob("*.safetensors"))
            for name, tensor in load_file(f).items()
        }

    def operations(self, model_id: str, op_type: str) -> int:
        with self.db.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT count(*) FROM operations WHERE session_id = :m AND type = :t"),
                    {"m": model_id, "t": op_type},
                ).scalar_one()
            )


@pytest.fixture(scope="module")
def tenant(platform: Platform) -> Iterator[Tenant]:
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"dimuon-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    own = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
    engine = db.connect(platform.database_url, pool_size=1)
    yield Tenant(platform, key, svc, own, engine)
    own.close()
    svc.close("success").result()
    engine.dispose()


@pytest.fixture(scope="module")
def dimuon_run(tenant: Tenant) -> tinker.TrainingClient:
    return tenant.svc.create_lora_training_client(
        BASE_MODEL, rank=4, seed=5, optimizer=types.DimuonOptimizerConfig()
    ).result()


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert any(k.startswith("optimizer") and k.endswith(".momentum_buffer") for k in a), sorted(a)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def test_save_state_then_resume_continues_bit_for_bit_and_replays(
    tenant: Tenant, dimuon_run: tinker.TrainingClient, tmp_path: Path
) -> None:
    tc = dimuon_run
    assert tc.get_info().optimizer_config.type == "dimuon"  # type: ignore[union-attr]
    for step in range(3):
        _step(tc, step)
    mid = tc.save_state("mid").result().path
    for step in range(3, 5):
        _step(tc, step)
    end = tc.save_state("end").result().path

    resumed = tenant.svc.create_training_client_from_state_with_optimizer(mid).result()
    assert resumed.get_info().optimizer_config.type == "dimuon"  # type: ignore[union-attr]
    for step in range(3, 5):
        _step(resumed, step)
    again = resumed.save_state("end-resumed").result().path
    _assert_bit_identical(
        tenant.tensors(end, tmp_path / "a"), tenant.tensors(again, tmp_path / "b")
    )

    report = tenant.treadle.replay(tc.model_id).report
    assert report.matched, str(report)
    assert (report.replayed, report.verified) == (11, 11)  # create_model + 5 x (fb + optim)
    fork = tenant.treadle.fork_training_client(tc.model_id, at_seq=report.to_seq)
    forked = fork.save_state("fork").result().path
    _assert_bit_identical(
        tenant.tensors(end, tmp_path / "c"), tenant.tensors(forked, tmp_path / "d")
    )


def test_adam_params_to_a_dimuon_model_are_refused_recording_nothing(
    tenant: Tenant, dimuon_run: tinker.TrainingClient
) -> None:
    before = tenant.operations(dimuon_run.model_id, "optim_step")
    with pytest.raises(tinker.BadRequestError, match="created with dimuon .*send DimuonParams"):
        dimuon_run.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert tenant.operations(dimuon_run.model_id, "optim_step") == before
    _step(dimuon_run, 9)  # the refused seq_id leaves no gap


def test_dimuon_params_to_an_adam_model_are_refused_recording_nothing(tenant: Tenant) -> None:
    tc = tenant.svc.create_lora_training_client(BASE_MODEL, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="created with adamw .*send AdamParams"):
        tc.optim_step(DIMUON).result()
    assert tenant.operations(tc.model_id, "optim_step") == 0
    _step(tc, 0, types.AdamParams(learning_rate=1e-3))


def test_loading_dimuon_state_into_an_adam_model_is_refused(
    tenant: Tenant, dimuon_run: tinker.TrainingClient
) -> None:
    path = dimuon_run.save_state("for-adam").result().path
    adam = tenant.svc.create_lora_training_client(BASE_MODEL, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="holds dimuon optimizer state"):
        adam.load_state_with_optimizer(path).result()
    # its weights alone train with the optimizer the new model asks for
    weights_only = tenant.svc.create_training_client_from_state(path).result()
    assert weights_only.get_info().optimizer_config.type == "adamw"  # type: ignore[union-attr]
    _step(weights_only, 0, types.AdamParams(learning_rate=1e-3))


def test_unknown_optimizers_and_dimuon_fields_are_refused(
    tenant: Tenant, dimuon_run: tinker.TrainingClient
) -> None:
    with tenant.http() as http:
        created = http.post(
            "/api/v1/create_model",
            json={
                "session_id": "s-refused",
                "model_seq_id": 0,
                "base_model": BASE_MODEL,
                "lora_config": {"rank": 4},
                "optimizer_config": {"type": "sgd"},
            },
        )
        assert created.status_code == 400, created.text
        assert "optimizer_config.type 'sgd' is not served" in created.text
        stepped = http.post(
            "/api/v1/optim_step",
            json={
                "model_id": dimuon_run.model_id,
                "seq_id": 1000,
                "optimizer_params": {"type": "dimuon", "learning_rate": 0.1, "damping": 0.5},
            },
        )
        assert stepped.status_code == 400, stepped.text
        assert "optimizer_params.damping" in stepped.text
