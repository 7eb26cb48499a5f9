"""The code sandbox keeps each promise of treadle.recipes.sandbox: tests decide pass or fail, and
the network, writes outside its folder, subprocesses, and runs past the CPU, wall-clock, memory
or file-size limits are stopped. Each test would fail if its guard were missing."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest

from treadle.recipes.sandbox import Limits, run

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def test_correct_code_passes() -> None:
    result = run(ADD, ADD_TESTS)
    assert result.passed and result.outcome == "passed", result


def test_wrong_code_fails() -> None:
    result = run("def add(a, b):\n    return a - b\n", ADD_TESTS)
    assert not result.passed and result.outcome == "failed", result
    assert "AssertionError" in result.stderr


def test_a_connection_to_a_listening_socket_is_refused_and_never_arrives() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            f"s = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\n"
            "s.sendall(b'hello')\n"
        )
        result = run(code)
        listener.settimeout(0.5)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert result.outcome == "refused" and "socket" in result.detail, result


def test_a_write_outside_the_sandbox_is_refused_and_the_file_does_not_appear(
    tmp_path: Path,
) -> None:
    target = tmp_path / "escaped.txt"
    result = run(f"open({str(target)!r}, 'w').write('out')\n")
    assert result.outcome == "refused" and str(target) in result.detail, result
    assert not target.exists()


def test_a_write_inside_the_sandbox_works() -> None:
    code = "open('notes.txt', 'w').write('kept')\n"
    result = run(code, "assert open('notes.txt').read() == 'kept'\n")
    assert result.passed, result


def test_a_cpu_bound_loop_is_killed_by_the_cpu_limit() -> None:
    result = run("while True:\n    pass\n", limits=Limits(cpu_seconds=1, wall_seconds=30))
    assert result.outcome == "timeout" and "CPU limit" in result.detail, result
    assert result.seconds < 20


def test_a_sleeper_is_killed_by_the_wall_clock_limit() -> None:
    result = run("import time\ntime.sleep(100)\n", limits=Limits(wall_seconds=1))
    assert result.outcome == "timeout" and "wall-clock" in result.detail, result
    assert result.seconds < 5


def test_allocating_2_gib_is_stopped_by_the_memory_limit() -> None:
    result = run("block = bytearray(2 * 1024**3)\n", "assert len(block) > 0\n")
    assert result.outcome == "memory", result


def test_a_file_past_the_size_limit_is_stopped() -> None:
    code = "open('big.bin', 'wb').write(b'x' * 2 * 1024 * 1024)\n"
    result = run(code, limits=Limits(file_bytes=1024 * 1024))
    assert result.outcome == "error" and "File too large" in result.detail, result


def test_spawning_a_subprocess_is_refused() -> None:
    result = run("import os\nos.system('echo spawned > spawned.txt')\n")
    assert result.outcome == "refused" and "os.system" in result.detail, result
    assert "spawned" not in result.stdout


def test_the_sandbox_folder_is_gone_afterwards() -> None:
    result = run("import os\nprint(os.getcwd())\n")
    box = Path(result.stdout.strip())
    assert box.name == "box" and box.is_relative_to(tempfile.gettempdir()), result
    assert not box.exists() and not box.parent.exists()


def test_exiting_before_the_tests_run_is_not_a_pass() -> None:
    result = run("import os\nos._exit(0)\n", ADD_TESTS)
    assert not result.passed and result.outcome == "error", result
