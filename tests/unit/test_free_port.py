"""`free_port`: a port for a server about to start, below the ephemeral range or inside
TREADLE_PORT_RANGE; and the disjoint blocks parallel test processes get (tests/conftest.py)."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import xdist_port_block
from treadle.platform.embedded import (
    PORT_FLOOR,
    PORT_RANGE_ENV,
    ephemeral_port_range,
    free_port,
    parse_port_range,
)


def test_a_port_comes_from_the_range_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "23400-23409")
    ports = {free_port() for _ in range(50)}
    assert ports <= set(range(23400, 23410))
    assert len(ports) > 1  # picked at random within it


def test_a_port_in_use_is_never_given(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        monkeypatch.setenv(PORT_RANGE_ENV, f"{port}-{port}")
        with pytest.raises(RuntimeError, match=f"no free port found in {port}..{port}"):
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


def test_parallel_test_processes_get_disjoint_blocks_covering_the_range() -> None:
    blocks = [parse_port_range(xdist_port_block(f"gw{i}", 3, "20000-29999")) for i in range(3)]
    assert blocks == [(20000, 23332), (23333, 26665), (26666, 29998)]
    low, _ = ephemeral_port_range()
    default = [parse_port_range(xdist_port_block(f"gw{i}", 2, "")) for i in range(2)]
    assert default[0][0] == PORT_FLOOR and default[0][1] < default[1][0] and default[1][1] < low


def test_one_process_or_a_small_range_keeps_the_range_as_it_is() -> None:
    assert xdist_port_block("", 2, "") == ""  # not under xdist
    assert xdist_port_block("gw0", 1, "") == ""
    assert xdist_port_block("gw1", 2, "20000-20999") == ""  # 500 ports each: too few to slice
