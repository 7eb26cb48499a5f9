"""Worker groups as processes: `treadle worker --devices N` on one host.

The command's process becomes torchrun (`torch.distributed.run --standalone`, no restarts): it
starts N ranks, each `treadle worker` again with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and when any rank ends it ends the others and exits, so
whoever started the worker (`treadle up`'s supervisor, compose's restart policy) starts a new
group, which claims the sessions back and rebuilds them from their checkpoints and logs. Rank 0
is the worker the platform sees (`runtime.run_worker` with the group); the other ranks follow
it (`run_follower`). Each rank dies with torchrun (PR_SET_PDEATHSIG), so none is left behind.
Several hosts per group is torchrun's multi-node launch of the same command (docs/deploy.md).
Must not import flask or treadle.api.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import torch

from treadle.engine import Group, follow, init_from_env, leave
from treadle.platform import db
from treadle.platform.config import PlatformConfig
from treadle.worker.runtime import new_engine, run_worker

__all__ = ["is_rank", "launch", "run_follower", "run_rank"]

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def is_rank() -> bool:
    """Whether this process is a rank torchrun started (rather than the command a user ran)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(worker_id: str, devices: int, layout: str) -> None:
    """Become torchrun, starting `devices` ranks of worker `worker_id` holding base models in
    `layout`; never returns."""
    env = {**os.environ, "TREADLE_GROUP_LAYOUT": layout}
    # torchrun sets one OpenMP thread per rank unless told; a rank runs a part on the threads
    # one worker would, so a part's float results do not depend on the world size.
    env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={devices}", "--max-restarts=0", "--monitor-interval=0.5",
        "-m", "treadle.cli", "worker", "--worker-id", worker_id, "--devices", str(devices),
    ]  # fmt: skip
    log.info("%s: starting a group of %d ranks (%s)", worker_id, devices, layout)
    os.execve(sys.executable, argv, env)


def run_rank(config: PlatformConfig, worker_id: str) -> None:
    """One rank of worker `worker_id`'s group: rank 0 runs the worker, the others follow."""
    _die_with_parent()
    group = init_from_env(config.group_timeout_seconds, config.device, config.group_layout)
    tag = _RankTag(worker_id, group.rank, group.world_size)
    for handler in logging.getLogger().handlers:  # every line says which rank of which group
        handler.addFilter(tag)
    if group.is_leader:
        run_worker(config, worker_id, group=group)
    else:
        run_follower(config, worker_id, group)


def run_follower(config: PlatformConfig, worker_id: str, group: Group) -> None:
    """A rank other than 0: an engine of its own (its own spill folder), running what rank 0
    sends until it closes the group."""
    database = db.connect(config.database_url, pool_size=1)
    engine = new_engine(
        config,
        database,
        spill_dir=config.spill_dir(f"{worker_id}.rank{group.rank}"),
        group=group,
        device=_device(config, group),
    )
    log.info(
        "%s: rank %d of %d following rank 0 (%s)",
        worker_id, group.rank, group.world_size, group.layout,
    )  # fmt: skip
    try:
        follow(engine, group)
    finally:
        leave(engine)
        database.dispose()


class _RankTag(logging.Filter):
    """Adds the group (the worker's id), the rank and the world size to every log record."""

    def __init__(self, worker_id: str, rank: int, world_size: int) -> None:
        super().__init__()
        self.worker_id, self.rank, self.world_size = worker_id, rank, world_size

    def filter(self, record: logging.LogRecord) -> bool:
        record.group = self.worker_id
        record.rank = self.rank
        record.world_size = self.world_size
        return True


def _device(config: PlatformConfig, group: Group) -> str | None:
    """This rank's device: its own GPU (LOCAL_RANK), or the configured device."""
    if torch.cuda.is_available() and (config.device or "cuda").startswith("cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', group.rank))}"
    return config.device


def _die_with_parent() -> None:
    """Be killed when torchrun goes, however it goes (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: torchrun still ends its ranks when it exits normally
        pass
