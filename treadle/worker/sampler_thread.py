"""The host's sampling thread, for an engine whose samples run beside training.

With vLLM (`EngineAPI.samples_beside_training`) a sample costs the worker's process only
requests to vLLM's own processes, so samples need not wait for the Celery thread, which runs one
task at a time and may be in a long `forward_backward`. `SamplerThread` runs the host's sample
batches (`SampleBatches.run_beside`) on a thread of its own: poked by each sample's wake-up,
and, while the Celery thread runs an operation (whose task holds back the wake-ups queued behind
it), looking for waiting samples itself every `BUSY_LOOK_SECONDS`. Imports platform and the
engine through the host; never api.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from treadle.worker.running import WorkerClosing
from treadle.worker.sample_batches import SampleBatches

__all__ = ["SamplerThread"]

log = logging.getLogger(__name__)

# While the Celery thread runs an operation, the sampling thread looks for waiting samples this
# often (their wake-ups wait behind that operation's task). Idle, it waits for a wake-up, and
# looks at least every IDLE_LOOK_SECONDS all the same.
BUSY_LOOK_SECONDS = 0.05
IDLE_LOOK_SECONDS = 2.0
# After a batch failed outside the engine (the database, say), the next look waits this long.
FAILED_PAUSE_SECONDS = 1.0


class SamplerHost(Protocol):
    """What the sampling thread needs of the session host (`host.SessionHost`)."""

    worker_id: str
    closing: threading.Event
    samples: SampleBatches

    def busy(self) -> bool: ...


class SamplerThread:
    """Runs `host`'s sample batches beside its training, until the host closes."""

    def __init__(self, host: SamplerHost) -> None:
        self._host = host
        self._poked = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"samples-{host.worker_id}", daemon=True
        )
        self._thread.start()

    def poke(self) -> None:
        """A sample is waiting (its snapshot made): look now."""
        self._poked.set()

    def close(self, timeout: float = 30.0) -> None:
        """Wait for the thread, the host closing (what it ran stays pending)."""
        self._poked.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        host = self._host
        while not host.closing.is_set():
            self._poked.wait(BUSY_LOOK_SECONDS if host.busy() else IDLE_LOOK_SECONDS)
            self._poked.clear()
            try:
                while not host.closing.is_set() and host.samples.run_beside():
                    pass
            except WorkerClosing:
                return  # what was cut short stays pending for the next holder
            except Exception:  # the database or Redis failed: the samples stay pending
                log.exception("%s: the sampling thread failed; it goes on", host.worker_id)
                host.closing.wait(FAILED_PAUSE_SECONDS)
