"""A child started through `ending_with_parent` runs its own command line and ends when the
process that started it is killed outright (nothing of the parent's runs at its end)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

PARENT = """
import subprocess, sys, time
from treadle.platform.child_process import ending_with_parent
child = subprocess.Popen(ending_with_parent(["sleep", "300"]))
print(child.pid, flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_child_runs_its_command_and_ends_with_a_killed_parent() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}/cmdline").read_bytes() != b"sleep\x00300\x00":
        assert time.monotonic() < deadline, "the bootstrap never ran the command"
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.05)
