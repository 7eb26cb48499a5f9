"""A worker killed with SIGKILL while it runs a forwardBackward submitted through SageMaker's
runtime, by the official `sagemaker-train` SDK: the loop ends with no client error, and its
losses and final weights and optimizer state equal an uninterrupted run's, bit for bit (the state
hashes the platform records, and the saved state's files)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import redis
import sqlalchemy as sa

from tests.compat.users import aws_env, new_aws_user
from tests.fault.conftest import Up, wait_for
from tests.fault.loop import assert_settled_once
from treadle.worker import faults

pytestmark = pytest.mark.fault

STEPS = 5
STRIKE = 3  # the forwardBackward of this step is struck
ROLE = "arn:aws:iam::123456789012:role/SageMakerTrainingSessionsRole"
GROUP = "arn:aws:sagemaker:us-west-2:123456789012:model-package-group/faults"


@pytest.fixture(scope="module")
def aws(up: Up) -> Iterator[None]:
    """The SDK's environment: this platform, a new tenant's access key pair."""
    with mock.patch.dict(os.environ, aws_env(up.base_url, new_aws_user(up, "sagemaker-faults"))):
        yield


def batch(step: int) -> list[Any]:
    from sagemaker.train.training_session import Datum, ModelInput, TensorData

    data = []
    for row in range(2):
        ids = [(7 * step + 13 * row + 3 * i) % 250 + 1 for i in range(12)]
        data.append(
            Datum(
                model_input=ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData(data=ids[1:]),
                    "weights": TensorData(data=[1.0] * (len(ids) - 1)),
                },
            )
        )
    return data


def run(up: Up, name: str, strike: bool) -> dict[str, Any]:
    """The loop on a new session `name`; with `strike`, the holder of the session is killed
    while step STRIKE's forwardBackward holds after its effect, before its settlement."""
    from sagemaker.train.training_session import AdamParams, ServiceClient

    svc = ServiceClient(role_arn=ROLE, region="us-west-2")
    losses = []
    with svc.create_lora_training_client(
        "treadle/tiny-debug", training_session_name=name, rank=8, alpha=16,
        model_package_group_arn=GROUP, s3_output_path="s3://bucket/faults",
    ) as tc:  # fmt: skip
        session_id = session_of(up, name)
        pauses = redis.Redis.from_url(up.redis_url)
        for step in range(STEPS):
            if strike and step == STRIKE:
                faults.arm_pause(pauses, session_id, "forward_backward", 30.0)
            fb = tc.forward_backward(batch(step), loss_fn="cross_entropy")
            opt = tc.optim_step(AdamParams(learning_rate=1e-2))
            if strike and step == STRIKE:
                wait_for(lambda: pauses.get(faults.paused_key(session_id)), 30, "the pause")
                worker = up.holder(session_id)[0]
                os.kill(up.worker_pids()[worker], signal.SIGKILL)
            losses.append(fb.result().metrics["loss:sum"])
            opt.result()
        state = tc.save_state().result().model_package_arn
    pauses.close()
    return {"losses": losses, "session_id": session_id, "state": state}


def session_of(up: Up, name: str) -> str:
    with up.db.connect() as conn:
        return str(
            conn.execute(
                sa.text("SELECT session_id FROM sagemaker_sessions WHERE name = :n"), {"n": name}
            ).scalar_one()
        )


def recorded(up: Up, session_id: str) -> dict[str, Any]:
    """The state hashes of the session's last optimizer step, and its saved state's files."""
    with up.db.connect() as conn:
        state = conn.execute(
            sa.text(
                "SELECT state FROM operations WHERE session_id = :s AND type = 'optim_step' "
                "AND status = 'completed' ORDER BY seq_id DESC LIMIT 1"
            ),
            {"s": session_id},
        ).scalar_one()
        prefix = conn.execute(
            sa.text("SELECT storage_prefix FROM checkpoints WHERE session_id = :s"),
            {"s": session_id},
        ).scalar_one()
    files = sorted((up.data_dir / "storage" / prefix).rglob("*.safetensors"))
    assert files, "the saved state has its files"
    return {"state": state, "files": {f.name: f.read_bytes() for f in files}}


def test_kill_during_a_forward_backward_is_invisible_to_the_sdk(up: Up, aws: None) -> None:
    reference = run(up, "faults-reference", strike=False)
    up.wait_ready(2)
    struck = run(up, "faults-struck", strike=True)
    assert struck["losses"] == reference["losses"]
    assert recorded(up, struck["session_id"]) == recorded(up, reference["session_id"])
    assert up.events(struck["session_id"], "SessionRecovered"), "the next holder rebuilt it"
    assert_settled_once(up, struck["session_id"])
