"""What a worker's heartbeat asks the engine (`worker/lease_keeper.py`) is answered while a call
runs: a heartbeat that waited for a long sample went stale, and another worker took the
sessions of this one while it was serving them (leases passed back and forth until the client's
operation timed out)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.unit.engine_support import shared_cache_dir
from treadle.engine import Engine
from treadle.platform.models.catalog import TINY_DEBUG_NAME


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_cache_dir(tmp_path_factory)


def test_the_heartbeats_questions_do_not_wait_for_the_running_call(cache_dir: Path) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu")
    engine.load_base(TINY_DEBUG_NAME)
    answers: dict[str, Any] = {}

    def heartbeat() -> None:
        answers["loaded"] = engine.has_base(TINY_DEBUG_NAME)
        answers["other"] = engine.has_base("not/loaded")
        answers["adapters"] = engine.adapter_counts()

    with engine._lock:  # as a running call holds it
        asking = threading.Thread(target=heartbeat, daemon=True)
        asking.start()
        asking.join(timeout=10)
        assert not asking.is_alive(), "the heartbeat waited for the running call"
    assert answers == {"loaded": True, "other": False, "adapters": (0, 0)}
