"""What `ServiceClient.replay` returns: the report of a verified replay of a session's log and a
training client on the read-only sandbox it built. Imports nothing from the server side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.client.training import TrainingClient


@dataclass(frozen=True)
class Divergence:
    """The first operation whose replayed state differs from what its first run recorded."""

    seq_id: int
    operation: str
    part: str  # weights, grads, optimizer, or files / outcome
    recorded: str
    replayed: str


@dataclass(frozen=True)
class ReplayReport:
    """How a replay went. `status`: running, matched, diverged or failed (see `error`)."""

    model_id: str
    source_session_id: str
    to_seq: int
    status: str
    replayed: int = 0  # operations replayed
    verified: int = 0  # of those, state-changing ones whose state hashes matched
    first_divergence: Divergence | None = None
    seconds: float | None = None  # the replay's compute
    original_seconds: float | None = None  # what the same operations took when they first ran
    error: str | None = None

    @property
    def matched(self) -> bool:
        return self.status == "matched"

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ReplayReport:
        first = body.get("first_divergence")
        return cls(
            model_id=body["model_id"],
            source_session_id=body["source_session_id"],
            to_seq=body["source_seq"],
            status=body["status"],
            replayed=body.get("replayed", 0),
            verified=body.get("verified", 0),
            first_divergence=None if not first else Divergence(**first),
            seconds=body.get("seconds"),
            original_seconds=body.get("original_seconds"),
            error=body.get("error"),
        )

    def __str__(self) -> str:
        head = (
            f"replay of {self.source_session_id} to seq {self.to_seq}: {self.status}, "
            f"{self.replayed} operations replayed, {self.verified} state changes verified"
        )
        if self.first_divergence is not None:
            d = self.first_divergence
            head += (
                f"; first divergence at seq {d.seq_id} ({d.operation}): {d.part} hash "
                f"{d.replayed} != recorded {d.recorded}"
            )
        if self.seconds is not None and self.original_seconds:
            head += f"; {self.seconds:.2f} s (the original run: {self.original_seconds:.2f} s)"
        if self.error:
            head += f": {self.error}"
        return head


@dataclass(frozen=True)
class Replay:
    """A replay's report and a client on its sandbox (sample from it; it refuses training)."""

    report: ReplayReport
    training_client: TrainingClient
