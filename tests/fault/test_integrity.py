"""Recovery proves what it rebuilt: an automatic checkpoint altered on disk marks the session
diverged (no operation succeeds on wrong weights), and a session loaded from a checkpoint its
user then deleted still recovers."""

from __future__ import annotations

import json
import os
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
import tinker

from tests.fault.conftest import Up, wait_for
from tests.fault.loop import STEPS, Loop, assert_same, assert_settled_once

pytestmark = pytest.mark.fault


def _latest_auto_checkpoint(up: Up, model_id: str) -> Path:
    with up.db.connect() as conn:
        prefix = conn.execute(
            sa.text(
                "SELECT storage_prefix FROM auto_checkpoints WHERE session_id = :id "
                "AND kind = 'auto' AND deleted_at IS NULL ORDER BY seq_id DESC LIMIT 1"
            ),
            {"id": model_id},
        ).scalar_one()
    return up.data_dir / "storage" / prefix


def _flip_lowest_bit_of_first_weight(path: Path) -> None:
    """Change one float in a safetensors file by one ulp; the file stays valid."""
    raw = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    first = min((v for k, v in header.items() if k != "__metadata__"),
                key=lambda v: v["data_offsets"][0])  # fmt: skip
    at = 8 + header_len + first["data_offsets"][0]
    value = np.frombuffer(bytes(raw[at : at + 4]), dtype="<f4").copy()
    value.view("<u4")[0] ^= 1
    raw[at : at + 4] = value.tobytes()
    path.write_bytes(bytes(raw))


def _last_completed_seq(up: Up, model_id: str) -> int:
    return max(e["seq_id"] for e in up.events(model_id, "OperationCompleted"))


def test_altered_automatic_checkpoint_marks_the_session_diverged(up: Up) -> None:
    up.wait_ready(2)
    loop = Loop(up, name="altered-checkpoint")
    loop.run(range(4))  # automatic checkpoints every 3 optimizer steps
    point = _latest_auto_checkpoint(up, loop.model_id)
    _flip_lowest_bit_of_first_weight(point / "adapter_model.safetensors")
    last = _last_completed_seq(up, loop.model_id)
    holder = up.holder(loop.model_id)[0]
    os.kill(up.worker_pids()[holder], signal.SIGKILL)
    with pytest.raises(tinker.TinkerError, match="diverged"):
        loop.step(4)
    diverged = wait_for(lambda: up.events(loop.model_id, "SessionDiverged"), 30, "divergence")
    assert diverged[0]["part"] == "weights"
    assert _last_completed_seq(up, loop.model_id) == last, "nothing ran on the altered weights"
    with up.db.connect() as conn:
        status = conn.execute(
            sa.text("SELECT status FROM sessions WHERE id = :id"), {"id": loop.model_id}
        ).scalar_one()
    assert status == "Diverged"
    loop.close()


def test_session_loaded_from_a_deleted_checkpoint_recovers(up: Up) -> None:
    up.wait_ready(2)
    source = Loop(up, name="source")
    source.run(range(3))
    path = source.tc.save_state("start").result().path
    svc = source.svc
    loaded, reference = (
        Loop(up, name=name, svc=svc, tc=svc.create_training_client_from_state_with_optimizer(path))
        for name in ("loaded", "loaded-reference")
    )
    svc.checkpoints.delete(path)
    reference.run(range(3, STEPS))  # uninterrupted, all before the kill
    expected = reference.finish()
    loaded.run(range(3, 5))
    holder = up.holder(loaded.model_id)[0]
    os.kill(up.worker_pids()[holder], signal.SIGKILL)
    loaded.run(range(5, STEPS))
    assert_same(loaded.finish(), expected)
    assert_settled_once(up, loaded.model_id)
    assert up.events(loaded.model_id, "SessionRecovered")
    svc.close()
