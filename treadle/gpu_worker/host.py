"""The session host: runs each leased session's operations on the engine, strictly in order.

A wake-up names a session and a request; the host reads the log, applies the session's next
training operations in seq_id order (a duplicate is dropped, a gap waits for its request, or is
skipped once it has waited GAP_TIMEOUT), runs sample operations as they come, and settles each
outcome in one transaction guarded by its lease epoch. A session whose adapter is not in memory
(a restarted worker) is rebuilt by replaying its completed operations from the log.
Imports platform and the engine; never api.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import redis
import sqlalchemy as sa

from treadle.gpu_worker import checkpoint_io
from treadle.gpu_worker.engine import (
    AdamSpec,
    Engine,
    EngineDatum,
    LoraSpec,
    SamplingSpec,
)
from treadle.platform import events, notify, operations
from treadle.platform import sessions as sessions_core
from treadle.platform.errors import TreadleError
from treadle.platform.storage import ObjectStore

log = logging.getLogger(__name__)

# Long enough for a client's own work between reserved seq_ids (forward_backward_custom computes
# its loss locally between two of them); a seq_id refused at admission stalls later ones this long.
GAP_TIMEOUT_SECONDS = 60.0
REPLAYED_TYPES = (
    "create_model",
    "load_weights",
    "forward_backward",
    "optim_step",
    "save_weights_for_sampler",
)
Registration = Callable[[sa.Connection], None]


class SessionHost:
    def __init__(
        self,
        *,
        db: sa.Engine,
        redis_client: redis.Redis,
        engine: Engine,
        store: ObjectStore,
        worker_id: str,
    ) -> None:
        self.db = db
        self.store = store
        self.redis = redis_client
        self.engine = engine
        self.worker_id = worker_id
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)

    # --- entry points (Celery tasks) --------------------------------------------------------

    def wake(self, session_id: str, request_id: str) -> None:
        with self._locks[session_id]:
            with self.db.connect() as conn:
                session = sessions_core.get_session(conn, None, session_id)
                op = operations.get_operation(conn, None, request_id)
            if session.worker_id != self.worker_id:
                log.warning("%s: not the lease holder of %s; ignoring", self.worker_id, session_id)
                return
            if op.sampler_id is not None:
                if not op.is_done:
                    self._ensure_restored(session)
                    self._execute(session, op)
                return
            self._drain(session_id)

    def stop(self, session_id: str) -> None:
        with self._locks[session_id]:
            if self.engine.has_adapter(session_id):
                self.engine.drop_adapter(session_id)
                log.info(
                    "%s: dropped the adapter of stopped session %s", self.worker_id, session_id
                )

    # --- ordering ---------------------------------------------------------------------------

    def _drain(self, session_id: str) -> None:
        while True:
            with self.db.connect() as conn:
                session = sessions_core.get_session(conn, None, session_id)
                if session.worker_id != self.worker_id:
                    return
                next_seq = session.last_applied_seq + 1
                op = operations.pending_training_op(conn, session_id, next_seq)
                if op is None:
                    oldest = operations.oldest_pending_training_op(conn, session_id)
            if op is None:
                if oldest is None or oldest[1] < GAP_TIMEOUT_SECONDS:
                    return  # nothing to do, or the missing request may still arrive
                with self.db.begin() as conn:
                    operations.skip_gap(
                        conn, session_id, self.worker_id, session.lease_epoch, oldest[0]
                    )
                log.warning(
                    "%s: skipped seq %d..%d (never received)", session_id, next_seq, oldest[0] - 1
                )
                continue
            if op.is_done:  # settled by a previous holder; cannot happen with a current lease
                return
            if op.seq_id > 0:  # seq 0 creates the adapter (create_model or create-via-load)
                self._ensure_restored(session)
            self._execute(session, op)

    # --- execution --------------------------------------------------------------------------

    def _execute(self, session: sessions_core.SessionRow, op: operations.OperationRow) -> None:
        with self.db.connect() as conn:
            payload = events.read_at(conn, op.request_position).data["payload"]
        started = time.perf_counter()
        result: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        tokens = {"prefill": 0, "sample": 0, "train": 0}
        also: Registration | None = None
        try:
            result, tokens, also = self._apply(session, op.type, payload)
        except TreadleError as exc:
            error = {"category": exc.category, "code": exc.code, "message": exc.message}
        except Exception as exc:  # the engine failed: report it, keep the session going
            log.exception("%s: %s seq %d failed", session.id, op.type, op.seq_id)
            error = {
                "category": "server",
                "code": "internal",
                "message": f"{type(exc).__name__}: {exc}",
            }
        usage = {"duration_ms": round((time.perf_counter() - started) * 1000, 3), "tokens": tokens}
        try:
            with self.db.begin() as conn:
                settled = operations.settle(
                    conn,
                    op,
                    worker_id=self.worker_id,
                    lease_epoch=session.lease_epoch,
                    result=result,
                    error=error,
                    usage=usage,
                    also=also,
                )
        except operations.StaleLeaseError as exc:
            log.warning("refused a stale write: %s", exc)
            return
        if settled:
            notify.publish_done(self.redis, op.request_id)

    def _apply(
        self, session: sessions_core.SessionRow, op_type: str, payload: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, int], Registration | None]:
        tokens = {"prefill": 0, "sample": 0, "train": 0}
        if op_type == "create_model":
            if self.engine.has_adapter(session.id):
                self.engine.drop_adapter(session.id)
            self.engine.create_adapter(
                session.id, payload["base_model"], LoraSpec(**payload["lora_config"])
            )
            return {"model_id": session.id}, tokens, None
        if op_type == "load_weights":
            checkpoint_io.load(self.engine, self.store, session.id, payload)
            return {"model_id": session.id, "path": payload["path"]}, tokens, None
        if op_type == "save_weights":
            result, register = checkpoint_io.save(
                self.engine, self.store, session.id, session.tenant_id, payload
            )
            return result, tokens, register
        if op_type == "forward_backward":
            data = [
                EngineDatum(
                    tokens=tuple(d["tokens"]),
                    loss_fn_inputs={
                        name: np.asarray(t["data"], dtype=t["dtype"]).reshape(t["shape"])
                        for name, t in d["loss_fn_inputs"].items()
                    },
                )
                for d in payload["data"]
            ]
            out = self.engine.forward_backward(
                session.id,
                data,
                payload["loss_fn"],
                payload["loss_fn_config"],
                forward_only=payload["forward_only"],
            )
            tokens["prefill" if payload["forward_only"] else "train"] = out.train_tokens
            outputs = [
                {name: _tensor_json(arr) for name, arr in per_datum.items()}
                for per_datum in out.outputs
            ]
            return {"loss_fn_outputs": outputs, "metrics": out.metrics}, tokens, None
        if op_type == "optim_step":
            metrics = self.engine.optim_step(session.id, AdamSpec(**payload))
            return {"metrics": metrics}, tokens, None
        if op_type == "save_weights_for_sampler":
            self.engine.snapshot(session.id, payload["sampler_id"])
            return {"sampling_session_id": payload["sampler_id"]}, tokens, None
        if op_type == "sample":
            result, tokens = self._sample(session, payload)
            return result, tokens, None
        raise AssertionError(f"unknown operation type {op_type}")

    def _sample(
        self, session: sessions_core.SessionRow, payload: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, int]]:
        params = dict(payload["params"])
        stop = params.pop("stop")
        spec = SamplingSpec(
            **params, stop=None if stop is None else tuple(stop)
        )  # a list on the wire
        snapshot = payload.get("snapshot_id")
        if payload.get("checkpoint_prefix"):
            assert snapshot is not None, "a checkpoint sampler always names its snapshot"
            checkpoint_io.ensure_snapshot(
                self.engine, self.store, snapshot, session.base_model, payload["checkpoint_prefix"]
            )
        out = self.engine.sample(
            session.base_model,
            snapshot,
            payload["prompt"],
            payload["num_samples"],
            spec,
            prompt_logprobs=payload["prompt_logprobs"],
            topk_prompt_logprobs=payload.get("topk_prompt_logprobs", 0),
        )
        result = {
            "sequences": [
                {"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason}
                for s in out.sequences
            ],
            "prompt_logprobs": out.prompt_logprobs,
            "topk_prompt_logprobs": out.topk_prompt_logprobs,
        }
        return result, {"prefill": out.prefill_tokens, "sample": out.sample_tokens, "train": 0}

    # --- recovery ---------------------------------------------------------------------------

    def _ensure_restored(self, session: sessions_core.SessionRow) -> None:
        """Rebuild an adapter this process does not hold by replaying its completed operations."""
        if session.kind != "training" or self.engine.has_adapter(session.id):
            return
        with self.db.connect() as conn:
            done = operations.completed_training_ops(conn, session.id, session.last_applied_seq)
            requests = events.read_many(conn, [op.request_position for op in done])
        payloads = [requests[op.request_position].data["payload"] for op in done]
        replayed = 0
        for op, payload in zip(done, payloads, strict=True):
            if op.type not in REPLAYED_TYPES or (
                op.type == "forward_backward" and payload["forward_only"]
            ):
                continue
            self._apply(session, op.type, payload)
            replayed += 1
        log.info("%s: restored %s by replaying %d operations", self.worker_id, session.id, replayed)


def _tensor_json(array: np.ndarray) -> dict[str, Any]:
    dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
    return {"dtype": dtype, "shape": list(array.shape), "data": array.reshape(-1).tolist()}
