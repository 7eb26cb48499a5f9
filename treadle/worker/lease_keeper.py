"""The lease keeper: the worker's thread that keeps its sessions held, consumed and moving.

Every heartbeat it reports the worker (and what it can host, `capacity`), claims sessions no
live worker holds, consumes its sessions' queues (and stops consuming those it lost), re-wakes
stalled operations, expires idle sessions and checkpoints, frees the adapters of sessions it no
longer hosts, and interrupts an operation whose session was stopped. Imports platform and the
engine; never api.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery import Celery

from treadle.engine import Capacity, PassSettings, device_memory, model_footprint
from treadle.platform.checkpoints import checkpoints
from treadle.platform.config import PlatformConfig
from treadle.platform.eventlog import notify
from treadle.platform.models import registry
from treadle.platform.operations import cancellation, operations, recorded_samples
from treadle.platform.sessions import leases, routing
from treadle.platform.sessions import sessions as sessions_core
from treadle.worker.host import SessionHost

__all__ = ["STALL_SECONDS", "LeaseKeeper"]

log = logging.getLogger(__name__)

# engine.Engine's max_resident_adapters, which no worker changes: adapters on a GPU at once.
PAGED_IN_ADAPTERS = 16
# A pending operation this old gets a fresh wake-up (a message lost with a dead worker).
STALL_SECONDS = 3.0


class LeaseKeeper(threading.Thread):
    """Heartbeats the worker, claims sessions no live worker holds, keeps its sessions' queues
    consumed and moving, and interrupts an operation whose session was stopped."""

    def __init__(
        self, config: PlatformConfig, host: SessionHost, app: Celery, metrics_url: str | None = None
    ) -> None:
        super().__init__(name="lease-keeper", daemon=True)
        self.config = config
        # What the heartbeat tells the platform about this process (`treadle status` shows it).
        self.info: dict[str, Any] = {"pid": os.getpid(), "metrics_url": metrics_url}
        shards = 1
        group = host.engine.topology()
        if group is not None:
            self.info["world_size"] = group.world_size
            self.info["group_timeout_seconds"] = group.timeout_seconds
            self.info["layout"] = group.layout
            shards = group.shards
        self.host = host
        engine = host.engine
        on_host = 1 if group is None else group.world_size  # ranks of a group share a host
        # The adapters the device holds at once: on a GPU those paged in (at most 16, the
        # engine's max_resident_adapters), at most those in memory; on the CPU the device's
        # memory is the host's, which holds every loaded one.
        loaded = config.max_loaded_adapters
        resident = loaded
        if engine.device.type != "cpu":
            resident = min(x for x in (loaded, PAGED_IN_ADAPTERS) if x > 0)
        settings = PassSettings(
            device=engine.device,
            dtype=engine.dtype,
            shards=shards,
            ranks_on_host=on_host,
            microbatch_tokens=config.microbatch_tokens,
            sampler_kv_tokens=config.sampler_kv_tokens,
            checkpointing=config.activation_checkpointing,
            pack_cpu_weights=config.pack_cpu_weights,
            device_bytes=device_memory(engine.device),
        )
        self.capacity = Capacity(
            engine.device,
            engine.dtype,
            config.worker_model_memory_bytes,
            shards=shards,
            measure=lambda info: model_footprint(info, settings, config.cache_dir).as_dict(),
            resident_adapters=resident,
            sampler_kv_tokens=config.sampler_kv_tokens,
            host_memory_bytes=config.worker_host_memory_bytes,
        )
        self.app = app
        self.consuming: set[str] = set()
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._first = True
        host.on_not_holder = self.hand_off

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("lease keeper tick failed; retrying")
            self.stopped.wait(self.config.worker_heartbeat_seconds)

    def tick(self) -> None:
        me = self.host.worker_id
        self.host.engine.ping()  # a group's dead rank ends the group here, between operations
        with self.host.db.begin() as conn:
            # Retired models too: the sessions already on them still need a host.
            models = [m.info for m in registry.list_models(conn, include_retired=True)]
            report = self.capacity.report(models)
            # Base models stay loaded once loaded: admission counts them with or without sessions.
            report["loaded_models"] = [m.name for m in models if self.host.engine.has_base(m.name)]
            leases.heartbeat_worker(conn, me, {**self.info, **report})
            hostable = report["models"]
            ttl = self.config.lease_ttl_seconds
            # Only sessions this worker has the memory for (`admission`); the others wait for
            # a worker with room.
            claimed = [
                s
                for s in leases.unleased_sessions(conn, base_models=hostable)
                if leases.has_room_for(conn, me, s)
                and leases.lease_session(conn, s, me, only_if_unleased=True)
            ] + [
                s
                for s in leases.orphaned_sessions(conn, ttl, base_models=hostable)
                if leases.has_room_for(conn, me, s)
                and leases.lease_session(conn, s, me, only_if_unleased=False)
            ]
            mine = leases.sessions_leased_to(conn, me)
            stalled = operations.stale_pending(conn, mine, STALL_SECONDS)
            expired = checkpoints.reap_expired(conn)
            recorded_samples.purge_expired(conn)
            idle = self.config.session_idle_seconds
            failed = [
                request_id
                for session_id in (sessions_core.expire_idle(conn, idle) if idle > 0 else [])
                for request_id in cancellation.fail_pending(
                    conn,
                    session_id,
                    sessions_core.expired_message(session_id, idle),
                    code="session_expired",
                )
            ]
        for request_id in failed:
            notify.publish_done(self.host.redis, request_id)
        self.interrupt_if_stopped()
        self.host.forget_all_but(set(mine))
        for checkpoint in expired:
            self.host.store.delete_prefix(checkpoint.storage_prefix + "/")
            log.info("deleted expired checkpoint %s", checkpoint.path)
        with self._lock:
            for session_id in mine:
                if session_id not in self.consuming:
                    routing.start_consuming(self.app, me, session_id)
                    self.consuming.add(session_id)
            for session_id in self.consuming - set(mine):
                routing.stop_consuming(self.app, me, session_id)
                self.consuming.discard(session_id)
        # A session that just came here is rebuilt at once, not when its next operation comes.
        woken = set(mine if self._first else claimed)
        self._first = False
        for session_id in woken:
            routing.wake(self.app, session_id, None)
        for session_id, request_id in stalled:
            if session_id not in woken:
                routing.wake(self.app, session_id, request_id)
                woken.add(session_id)

    def interrupt_if_stopped(self) -> None:
        """Stop the running operation (or each sample of the running batch) at its next step
        if its session was stopped meanwhile."""
        op = self.host.running()
        for running in ([] if op is None else [op]) + self.host.running_samples():
            with self.host.db.connect() as conn:
                session = sessions_core.get_session(conn, None, running.session_id)
                current = operations.get_operation(conn, None, running.request_id)
            if not session.is_active or current.is_done:
                self.host.cancel(
                    running.request_id,
                    f"{running.type} was cancelled: model {running.session_id} was stopped",
                )

    def hand_off(self, session_id: str, request_id: str | None) -> None:
        """A wake-up for a session this worker no longer holds: stop consuming its queue now
        and send the wake-up on, so the holder gets it."""
        with self._lock:
            if session_id in self.consuming:
                routing.stop_consuming(self.app, self.host.worker_id, session_id)
                self.consuming.discard(session_id)
        routing.wake(self.app, session_id, request_id)
