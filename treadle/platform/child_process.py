"""Child processes that end with the process that started them, however it ends.

`ending_with_parent(command)` puts a small Python bootstrap in front of a command: in the child it
asks Linux to send it SIGTERM when the thread that started it goes (PR_SET_PDEATHSIG, which is
kept across exec), checks that this parent is still there, then execs the command, whose own
command line is unchanged. It is set in the child, not in `preexec_fn`, which a threaded parent
must not use. A worker killed outright then leaves no vLLM server holding its accelerator, and a
test process stopped by its time limit no platform running. Linux only: elsewhere the command
is returned as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["ending_with_parent"]

_BOOTSTRAP = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit('its parent is gone'); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def ending_with_parent(command: Sequence[str], *, python: str = sys.executable) -> list[str]:
    """`command`, started through `python` (any CPython: the bootstrap uses only its standard
    library) so that it gets SIGTERM when the thread that starts it goes: start it from a
    thread that lives as long as the child should (the main thread, or a pool's)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [python, "-c", _BOOTSTRAP, str(os.getpid()), *command]
