"""A worker group across two nodes, as docs/deploy.md launches one on several hosts: torchrun's
multi-node launch (`--nnodes 2 --nproc-per-node 1`, c10d rendezvous), one process per node,
each `treadle worker --worker-id ID --devices 2`, against a platform that runs no worker of its
own. The two nodes run on this machine; everything between them goes through the rendezvous and
the process group, as it would between hosts. Through the plain tinker SDK the fixed loop of
tests/compat/test_worker_groups.py ends bit-identical to one process, and the group is one
worker of two ranks in `treadle status`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.compat.test_worker_groups import (
    PART_TOKENS,
    check_same,
    live_worker,
    one_process,
    recorded_states,
    sdk_loop,
    tenant_key,
)
from tests.fault.conftest import FAULT_ENV, Up, start_up, wait_for
from tests.unit.engine_support import shared_cache_dir
from treadle.platform.embedded import free_port

pytestmark = [pytest.mark.integration, pytest.mark.own_services]

GROUP_ID = "two-nodes@localhost"


@pytest.fixture(scope="module")
def nodes_up() -> Iterator[Up]:
    """`treadle up` with no worker, and a group of two nodes of one rank each serving it."""
    env = {"TREADLE_MICROBATCH_TOKENS": str(PART_TOKENS), "TREADLE_GROUP_TIMEOUT_SECONDS": "30"}
    with start_up(workers=0, env=env) as up:
        node_env = {
            **os.environ, **FAULT_ENV, **env,
            "DATABASE_URL": up.database_url, "REDIS_URL": up.redis_url,
            "TREADLE_DATA_DIR": str(up.data_dir), "TREADLE_ADMIN_KEY": up.admin_key,
            # the threads one worker would have (torchrun gives a rank one unless told)
            "OMP_NUM_THREADS": str(torch.get_num_threads()),
        }  # fmt: skip
        port = free_port()
        logs = [(up.data_dir / f"node{n}.log").open("ab") for n in range(2)]
        nodes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--node-rank",
                    str(n),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--max-restarts",
                    "0",
                    "-m",
                    "treadle.cli",
                    "worker",
                    "--worker-id",
                    GROUP_ID,
                    "--devices",
                    "2",
                ],
                env=node_env,
                stdout=logs[n],
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for n in range(2)
        ]
        try:
            wait_for(lambda: up.live_workers() == 1, 120, "the two-node group's heartbeat")
            yield up
        finally:
            for node in nodes:
                node.send_signal(signal.SIGTERM)
            for node in nodes:
                try:
                    node.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    node.kill()
            for log in logs:
                log.close()


def test_a_group_of_two_nodes_trains_as_one_process_bit_for_bit(
    nodes_up: Up, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_id, steps, samples = sdk_loop(nodes_up, tenant_key(nodes_up, "nodes"))
    expected = one_process(shared_cache_dir(tmp_path_factory))
    check_same(expected, steps, recorded_states(nodes_up, model_id), samples)

    worker = live_worker(nodes_up)
    assert (worker["id"], worker["world_size"], worker["layout"]) == (GROUP_ID, 2, "replicated")
    assert Path(nodes_up.data_dir / "node1.log").stat().st_size > 0


def test_a_worker_id_celery_cannot_address_is_refused() -> None:
    """Without "@", Celery would name the node celery@ID while the session queues are handed
    to ID: the worker would claim sessions and never run them."""
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "worker", "--worker-id", "gpu-group-1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--worker-id must be NAME@HOST" in done.stderr and "gpu-group-1@" in done.stderr
