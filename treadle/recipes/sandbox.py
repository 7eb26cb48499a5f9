"""A local sandbox for model-written Python: run a solution against its unit tests in a child
process that cannot reach the network, cannot write outside its own temporary folder, and is
killed when it runs over its CPU, wall-clock, memory or file-size limits.

    result = run("def add(a, b):\n    return a + b", "assert add(1, 2) == 3")
    result.passed, result.outcome    # True, "passed"

What holds it in:
- a fresh temp folder per run: the child's cwd, HOME and TMPDIR; removed afterwards;
- its own process group, killed as a group at the wall-clock limit;
- rlimits (CPU seconds, address space, file size, open files; no core dumps);
- a network namespace of its own (`unshare(CLONE_NEWUSER | CLONE_NEWNET)`, no interfaces but a
  down loopback) where the kernel allows it, which Linux does without root on most distributions;
- in all cases, an audit hook (PEP 578), installed before the solution runs and impossible to
  remove from Python, that ends the run as "refused" on sockets, subprocesses, exec, fork, kill,
  ctypes, and any write, delete, rename or mkdir whose resolved path is outside the temp folder.

The limits are set by a small bootstrap in the child rather than in `preexec_fn`: the recipes
run sandboxes while another thread samples, and `preexec_fn` is not safe in a threaded parent.
This is a guard against accidents and careless code from a small model, not a hardened jail
against a determined attacker (that needs seccomp, a container or a VM).

The recipes reach it through `Sandbox`, an interface of one method, so a remote service (a
SandboxFusion server, say; docs/recipes/code_rl.md) can take its place; `LocalSandbox` is this one.
Imports only the standard library.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

Outcome = Literal["passed", "failed", "timeout", "memory", "error", "refused"]
MiB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """What one run may use. A recipe passes its own; the defaults suit small functions."""

    cpu_seconds: int = 2  # CPU time; SIGXCPU then SIGKILL a second later
    wall_seconds: float = 5.0  # real time, so a sleeping or blocked run ends too
    memory_bytes: int = 256 * MiB  # address space (RLIMIT_AS): an allocation past it fails
    file_bytes: int = 1 * MiB  # the largest file it may write (RLIMIT_FSIZE)
    open_files: int = 64  # file descriptors (RLIMIT_NOFILE)
    network_namespace: bool = True  # try a network namespace; the audit hook applies regardless
    tail_chars: int = 2000  # how much of stdout and stderr the result keeps (their ends)


@dataclass(frozen=True)
class Result:
    """One run: `passed` only if the tests ran to the end without an error.

    outcome: passed; failed (an assertion of the tests failed); timeout (CPU or wall-clock
    limit); memory (an allocation past the memory limit); error (any other exception, including
    a file past the size limit, or an exit before the tests finished); refused (the code tried
    something the sandbox forbids). `detail` says which, in words.
    """

    passed: bool
    outcome: Outcome
    detail: str
    stdout: str
    stderr: str
    seconds: float
    network: str  # "namespace" or "audit hook only"


class Sandbox(Protocol):
    """Where model-written code runs: `code`, then `tests` in its namespace, one Result. An
    implementation must never raise for anything the code does (a crash, a hang, a refused
    call are outcomes); it may raise when the sandbox itself is unusable."""

    def run(self, code: str, tests: str) -> Result: ...


@dataclass(frozen=True)
class LocalSandbox:
    """This module's sandbox, a child process per run on this machine, with its limits."""

    limits: Limits = Limits()

    def run(self, code: str, tests: str) -> Result:
        return run(code, tests, self.limits)


def run(code: str, tests: str = "", limits: Limits = Limits()) -> Result:
    """Run `code`, then `tests` in the same namespace, in a fresh sandbox; see the module doc."""
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="treadle-sandbox-") as root:
        box = Path(root) / "box"
        box.mkdir()
        out_path, err_path = Path(root) / "stdout", Path(root) / "stderr"
        report_r, report_w = os.pipe()
        args = [limits.cpu_seconds, limits.memory_bytes, limits.file_bytes, limits.open_files,
                int(limits.network_namespace)]  # fmt: skip
        started = time.monotonic()
        with out_path.open("wb") as out, err_path.open("wb") as err:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(report_w),
                     *(str(a) for a in args)],
                    stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=box,
                    env={"HOME": str(box), "TMPDIR": str(box), "PATH": "/usr/bin:/bin",
                         "LANG": "C.UTF-8"},
                    pass_fds=(report_w,), start_new_session=True,
                )  # fmt: skip
            finally:
                os.close(report_w)
            try:
                assert proc.stdin is not None
                payload = json.dumps({"code": code, "tests": tests})
                proc.stdin.write(f"{nonce}\n{payload}".encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass  # it died before reading: the exit status says why
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc.pid)
            proc.wait()
        seconds = time.monotonic() - started
        with os.fdopen(report_r, "rb") as f:
            report = f.read().decode(errors="replace")
        stdout = _tail(out_path, limits.tail_chars)
        stderr = _tail(err_path, limits.tail_chars)
    outcome, detail, network = _judge(report, nonce, proc.returncode, timed_out, limits)
    return Result(outcome == "passed", outcome, detail, stdout, stderr, round(seconds, 3), network)


def _judge(
    report: str, nonce: str, returncode: int, timed_out: bool, limits: Limits
) -> tuple[Outcome, str, str]:
    lines = [line.split(" ", 2) for line in report.splitlines() if line.startswith(nonce + " ")]
    started = bool(lines) and len(lines[0]) == 3 and lines[0][2] == "started"
    network = lines[0][1].replace("-", " ") if started else "unknown"
    if timed_out:
        return "timeout", f"killed at the wall-clock limit ({limits.wall_seconds:g} s)", network
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout", f"killed at the CPU limit ({limits.cpu_seconds} s)", network
    if not started or len(lines) < 2:
        return "error", f"exited with status {returncode} before the tests finished", network
    outcome, detail = lines[-1][1], lines[-1][2] if len(lines[-1]) > 2 else ""
    assert outcome in ("passed", "failed", "memory", "error", "refused"), outcome
    return outcome, detail, network  # type: ignore[return-value]


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pgid, signal.SIGKILL)


def _tail(path: Path, chars: int) -> str:
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 4 * chars))
        return f.read().decode(errors="replace")[-chars:]


# The child's first code. It reads the nonce and the program from stdin, leaves the network,
# sets the rlimits, installs the audit hook, and only then compiles and runs the program. Its
# verdict goes to a pipe of its own as "<nonce> <outcome> <detail>" lines.
_BOOTSTRAP = r"""
import os, sys, json, resource, traceback

def _main():
    report_fd, cpu, memory, fsize, nofile, want_netns = map(int, sys.argv[1:7])
    nonce = sys.stdin.readline().strip()
    program = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sandbox = os.path.realpath(os.getcwd())

    def say(outcome, detail=""):
        line = f"{nonce} {outcome} {detail}".replace("\n", " ")[:500] + "\n"
        os.write(report_fd, line.encode(errors="replace"))

    network = "audit-hook-only"
    if want_netns:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for flags in (0x10000000 | 0x40000000, 0x40000000):  # NEWUSER|NEWNET, NEWNET (root)
            if libc.unshare(flags) == 0:
                network = "namespace"
                break
        del libc, ctypes
        for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
            del sys.modules[name]
    say(network, "started")
    for res, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, fsize),
                       (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    refused = ("socket.", "subprocess.", "os.system", "os.exec", "os.fork", "os.forkpty",
               "os.posix_spawn", "os.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
               "ctypes.", "urllib.", "http.", "ftplib.", "smtplib.", "poplib.", "imaplib.",
               "nntplib.", "telnetlib.", "webbrowser.", "pty.", "os.startfile")
    refused_imports = {"_ctypes", "ctypes", "_posixsubprocess"}
    path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                   "os.link", "os.symlink", "os.truncate", "os.utime", "os.setxattr",
                   "os.removexattr", "os.chflags", "os.lchflags", "os.mkfifo", "os.mknod",
                   "shutil.rmtree", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
                   "shutil.copytree", "shutil.move", "shutil.chown", "shutil.make_archive",
                   "shutil.unpack_archive", "sqlite3.connect"}
    realpath, join, getcwd, isdir = os.path.realpath, os.path.join, os.getcwd, os.path.isdir
    fspath, fsdecode, exit_now, sep = os.fspath, os.fsdecode, os._exit, os.sep
    busy = [False]

    def inside(path):
        full = realpath(join(getcwd(), fsdecode(fspath(path))))
        return full == sandbox or full.startswith(sandbox + sep) or full == "/dev/null"

    def refuse(event, args):
        try:
            sys.stdout.flush()
        except Exception:
            pass
        say("refused", f"{event}{tuple(args)!r}"[:300])
        os.write(2, f"sandbox: refused {event}{tuple(args)!r}\n"[:400].encode(errors="replace"))
        exit_now(1)

    def hook(event, args):
        if busy[0]:
            return
        busy[0] = True
        try:
            if event.startswith(refused):
                refuse(event, args)
            elif event == "import" and args[0] in refused_imports:
                refuse(event, args[:1])
            elif event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
                mode, flags = args[1], args[2] if len(args) > 2 else 0
                writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & write_flags)
                # A folder outside may not be opened at all: its fd would let dir_fd= escape.
                if not inside(args[0]) and (writes or isdir(args[0])):
                    refuse(event, args)
            elif event in path_events:
                for arg in args:
                    if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg):
                        refuse(event, args)
        finally:
            busy[0] = False

    sys.addaudithook(hook)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    stage = "solution"
    try:
        exec(compile(program["code"], "solution.py", "exec"), namespace)
        stage = "tests"
        exec(compile(program["tests"], "tests.py", "exec"), namespace)
    except MemoryError:
        say("memory", f"MemoryError in the {stage} (limit {memory} bytes)")
        return
    except AssertionError as e:
        traceback.print_exc()
        say("failed" if stage == "tests" else "error", f"{stage}: AssertionError {e}")
        return
    except SystemExit as e:
        say("error", f"{stage}: exit({e.code}) before the tests finished")
        return
    except BaseException as e:
        traceback.print_exc()
        say("error", f"{stage}: {type(e).__name__}: {e}")
        return
    sys.stdout.flush()
    say("passed")

_main()
sys.stdout.flush()
os._exit(0)
"""
