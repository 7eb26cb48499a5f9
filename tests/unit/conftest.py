"""Unit-tier fixtures: one engine per module on CPU, sharing one model cache per test session.

(`engine` here is the training engine; the integration tier's `engine` is the database's.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support import shared_cache_dir

from treadle.engine import Engine


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_cache_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(cache_dir: Path) -> Engine:
    return Engine(cache_dir=cache_dir, device="cpu")
