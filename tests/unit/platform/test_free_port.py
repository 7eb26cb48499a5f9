"""`free_port`: a port for a server about to start, below the ephemeral range or inside
TREADLE_PORT_RANGE; and the disjoint blocks parallel test processes get (tests/conftest.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import port_block, xdist_index
from treadle.platform.embedded import (
    PORT_FLOOR,
    PORT_RANGE_ENV,
    ephemeral_port_range,
    free_port,
    parse_port_range,
    port_range,
)


def test_a_port_comes_from_the_range_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "23400-23409")
    ports = {free_port() for _ in range(50)}
    assert ports <= set(range(23400, 23410))
    assert len(ports) > 1  # picked at random within it


def test_a_port_in_use_is_never_given(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        port = free_port()
        taken.bind(("127.0.0.1", port))
        taken.listen()
        monkeypatch.setenv(PORT_RANGE_ENV, f"{port}-{port}")
        with pytest.raises(RuntimeError, match=f"no free port found in {port}..{port}"):
            free_port()


def test_a_range_inside_the_ephemeral_range_gives_no_port(monkeypatch: pytest.MonkeyPatch) -> None:
    low, _ = ephemeral_port_range()
    monkeypatch.setenv(PORT_RANGE_ENV, f"{low}-{low + 9}")
    with pytest.raises(RuntimeError, match=f"outside the ephemeral range {low}"):
        free_port()


def test_without_a_range_a_port_is_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    low, _ = ephemeral_port_range()
    assert all(PORT_FLOOR <= free_port() < low for _ in range(50))


@pytest.mark.parametrize("text", ["", "20000", "20000-", "a-b", "20000-20100-20200", "-5-10"])
def test_a_range_that_is_not_two_numbers_says_how_to_write_it(text: str) -> None:
    with pytest.raises(ValueError, match="write two port numbers, e.g. 20000-20999"):
        parse_port_range(text)


@pytest.mark.parametrize("text", ["20999-20000", "80-2000", "60000-70000"])
def test_a_range_out_of_order_or_bounds_says_what_is_needed(text: str) -> None:
    with pytest.raises(ValueError, match="need 1024 <= low <= high <= 65535"):
        parse_port_range(text)


def test_parallel_test_processes_get_disjoint_blocks_covering_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks = [parse_port_range(port_block((20000, 29999), i, 3)) for i in range(3)]
    assert blocks == [(20000, 23332), (23333, 26665), (26666, 29998)]
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    low, _ = ephemeral_port_range()
    default = [parse_port_range(port_block(port_range(), i, 2)) for i in range(2)]
    assert default[0][0] == PORT_FLOOR and default[0][1] < default[1][0] and default[1][1] < low


def test_a_process_replacing_a_crashed_one_gets_a_block_inside_the_range() -> None:
    # pytest-xdist names the replacement of gw0 (of 2) gw2: a block past the range would fall in
    # the ephemeral range, where free_port finds nothing, and every later test would error
    blocks = [parse_port_range(port_block((10000, 32767), i, 2)) for i in range(4)]
    assert blocks[2] == blocks[0] and blocks[3] == blocks[1]
    assert all(10000 <= low <= high <= 32767 for low, high in blocks)


def test_one_process_or_a_small_range_keeps_the_range_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert xdist_index() is None  # not under xdist: pytest_configure sets no block
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert xdist_index() == 3
    assert port_block((10000, 32767), 0, 1) == ""
    assert port_block((20000, 20999), 1, 2) == ""  # 500 ports each: too few to slice


PROBE = """
import json, os, subprocess, sys

def test_probe(tmp_path_factory):
    # A server's process as the platforms start it: a child inheriting the environment.
    child = subprocess.run(
        [sys.executable, "-c", "import json; from treadle.platform.embedded import free_port, "
         "port_range; print(json.dumps([port_range(), free_port()]))"],
        capture_output=True, text=True, check=True,
    )
    ports, port = json.loads(child.stdout)
    out = os.path.join(os.environ["PROBE_DIR"], os.environ["PYTEST_XDIST_WORKER"])
    with open(out, "w") as f:
        json.dump({"range": ports, "port": port}, f)
"""


def test_each_test_process_and_what_it_starts_pick_ports_from_a_block_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make test`'s two processes, with this suite's conftest, each run a child the way a
    platform is started: the children's ports come from two disjoint blocks."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    root = Path(__file__).resolve().parents[3]
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "-n", "2", "--dist", "each", "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
        cwd=root, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    seen = {name: json.loads((tmp_path / name).read_text()) for name in ("gw0", "gw1")}
    (low0, high0), (low1, high1) = (seen[name]["range"] for name in ("gw0", "gw1"))
    assert low0 == PORT_FLOOR and high0 < low1 and high1 < ephemeral_port_range()[0]
    for probe in seen.values():
        low, high = probe["range"]
        assert low <= probe["port"] <= high
