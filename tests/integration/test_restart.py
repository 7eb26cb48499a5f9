"""`treadle up` on the embedded default: stop it, start it on the same data dir, carry on."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.wire_client import WireClient, datum
from treadle.platform.embedded import free_port
from treadle.recipes.platform_process import LocalPlatform

pytestmark = pytest.mark.integration


def test_restart_on_same_data_dir_keeps_history_and_session(tmp_path: Path) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-restart-"))
    key = "tml-restart-" + secrets.token_hex(8)
    port = free_port()
    try:
        with LocalPlatform(data_dir, port, key) as first:
            client = WireClient(first.base_url, key)
            model_id = client.create_model()
            losses = []
            for step in range(2):
                fb = client.forward_backward(
                    model_id, 2 * step + 1, [datum([7, 8, 9, 10, 11])]
                ).json()
                client.optim_step(model_id, 2 * step + 2, lr=1e-2)
                losses.append(client.result(fb["request_id"]).metrics["loss:sum"])
            before = httpx.get(
                f"{first.base_url}/api/v1/treadle/sessions/{model_id}/events",
                headers={"X-API-Key": key},
            ).json()["events"]
        with LocalPlatform(data_dir, port, key) as second:
            client = WireClient(second.base_url, key)
            after = httpx.get(
                f"{second.base_url}/api/v1/treadle/sessions/{model_id}/events",
                headers={"X-API-Key": key},
            ).json()["events"]
            assert after[: len(before)] == before
            # The restarted worker rebuilds the adapter from the log and goes on training.
            fb = client.forward_backward(model_id, 5, [datum([7, 8, 9, 10, 11])]).json()
            loss = client.result(fb["request_id"]).metrics["loss:sum"]
        assert loss < losses[-1] < losses[0]
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_a_run_ended_by_sigterm_stops_its_embedded_platform(tmp_path: Path) -> None:
    """`timeout` or a scheduler ends a recipe with SIGTERM; the platform it started must not
    outlive it (PostgreSQL, Redis, the API and the worker holding the data dir)."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from treadle.platform.embedded import free_port\n"
        "from treadle.recipes.platform_process import LocalPlatform\n"
        "with LocalPlatform(Path(sys.argv[1]), free_port(), 'tml-term-0123456789') as p:\n"
        "    print(p.proc.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "platform")],
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    tree: list[psutil.Process] = []
    try:
        assert run.stdout is not None
        up = psutil.Process(int(run.stdout.readline()))
        tree = [up, *up.children(recursive=True)]
        assert len(tree) >= 3  # treadle up, its worker, PostgreSQL and Redis
        run.send_signal(signal.SIGTERM)
        assert run.wait(90) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert alive == []
    finally:
        for proc in [run, *tree]:  # nothing left behind, whatever failed
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                proc.kill()
