"""Recorded samples: what a sampling client created with `record_stability_info=True` sampled,
and the provenance checks of training data that names it.

A sample requested that way gets a `recorded_samples` row at admission, in the same transaction;
its sequences `<request_id>:<i>` are the operation's own result (tokens and the sampler's
per-token logprobs), so nothing a client sends can change them. A training datum's provenance
(`Datum.with_provenance`) names spans of those sequences; `resolve` checks every span (same
tenant, a sequence sampled from this session's weights, not expired, the datum's tokens equal the
recorded ones) and returns the recorded sampler logprob of every sampled target, which
`stable_reinforce` reads. Each use moves the record's expiry to now + the TTL.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from treadle.platform.errors import ValidationError
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.eventlog.results import SampleOutput
from treadle.platform.eventlog.schema import (
    checkpoints,
    operations,
    recorded_samples,
    samplers,
    sessions,
)
from treadle.platform.operations import operations as ops
from treadle.platform.sessions.sessions import SessionKind, SessionRow
from treadle.platform.tenancy.tenants import Principal

__all__ = ["Recorded", "purge_expired", "record", "resolve", "sampled_targets", "touch"]

log = logging.getLogger(__name__)


def _expiry(ttl_seconds: float) -> sa.ColumnElement[Any]:
    return sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, ttl_seconds)


def record(
    conn: sa.Connection,
    principal: Principal,
    *,
    request_id: str,
    sampler_id: str,
    prompt: Sequence[int],
    num_samples: int,
    ttl_seconds: float,
) -> None:
    """Record sample `request_id` (admitted in this transaction on `sampler_id`): its owner is
    the training session whose weights it samples (a checkpoint's session for a checkpoint
    sampler; none for a base model, whose sequences its client session's training sessions may
    use)."""
    sampler = conn.execute(
        sa.select(samplers, sessions.c.kind)
        .join(sessions, sessions.c.id == samplers.c.session_id)
        .where(samplers.c.id == sampler_id, samplers.c.tenant_id == principal.tenant_id)
    ).one()
    owner: str | None = None
    weights_seq: int | None = None
    if sampler.kind == SessionKind.TRAINING:
        owner = sampler.session_id
        if sampler.snapshot_id is not None:
            weights_seq = ops.snapshot_seq(conn, owner, sampler.snapshot_id)
    elif sampler.model_path is not None:
        owner = conn.execute(
            sa.select(checkpoints.c.session_id)
            .where(checkpoints.c.tinker_path == sampler.model_path)
            .order_by(checkpoints.c.id.desc())
            .limit(1)
        ).scalar_one_or_none()
    conn.execute(
        sa.insert(recorded_samples).values(
            request_id=request_id,
            tenant_id=principal.tenant_id,
            session_id=owner,
            client_session_id=sampler.client_session_id,
            sampler_id=sampler_id,
            snapshot_id=sampler.snapshot_id,
            model_path=sampler.model_path,
            weights_seq=weights_seq,
            prompt=list(prompt),
            num_samples=num_samples,
            expires_at=_expiry(ttl_seconds),
        )
    )
    log.info(
        "recording the %d sequences of sample %s for %s (weights %s) for %.0f s after last use",
        num_samples,
        request_id,
        owner or f"client session {sampler.client_session_id} (base model)",
        sampler.model_path or sampler.snapshot_id or "of the base model",
        ttl_seconds,
        extra={"request_id": request_id, "session_id": owner, "tenant_id": principal.tenant_id},
    )


@dataclass(frozen=True)
class Recorded:
    """One recorded sample as the checks read it."""

    request_id: str
    session_id: str | None
    client_session_id: str
    prompt: list[int]
    num_samples: int
    expires_at: datetime
    is_expired: bool
    status: str
    result: SampleOutput | None  # read once it completed


def _load(conn: sa.Connection, principal: Principal, request_ids: set[str]) -> dict[str, Recorded]:
    rows = conn.execute(
        sa.select(
            recorded_samples,
            (recorded_samples.c.expires_at <= sa.func.now()).label("is_expired"),
            operations.c.status,
            operations.c.result,
        )
        .join(operations, operations.c.request_id == recorded_samples.c.request_id)
        .where(
            recorded_samples.c.request_id.in_(sorted(request_ids)),
            recorded_samples.c.tenant_id == principal.tenant_id,
        )
    )
    return {
        r.request_id: Recorded(
            r.request_id,
            r.session_id,
            r.client_session_id,
            list(r.prompt),
            r.num_samples,
            r.expires_at,
            bool(r.is_expired),
            r.status,
            None if r.result is None else SampleOutput.model_validate(r.result),
        )
        for r in rows
    }


def sampled_targets(spans: Sequence[Mapping[str, Any]], n: int) -> list[int] | None:
    """Per target, 1 where the datum's target provenance `spans` mark it sampled and 0 where a
    prompt token, without reading any record (the KL metric's action mask: nothing is trained
    on it); None unless the spans tile the `n` targets exactly."""
    if sum(int(s["length"]) for s in spans) != n:
        return None
    return [int(s["kind"] == "sampled") for s in spans for _ in range(int(s["length"]))]


def _parse(sequence_id: str) -> tuple[str, str]:
    """(the sample's request id, the sequence's index as sent): ids are `<request_id>:<i>`."""
    request_id, _, index = sequence_id.rpartition(":")
    return request_id, index


def resolve(
    conn: sa.Connection,
    principal: Principal,
    session: SessionRow,
    data: Sequence[Mapping[str, Any]],
    *,
    ttl_seconds: float,
) -> tuple[list[list[float | None]], set[str]]:
    """Check every datum's provenance against the recorded sequences; return per datum the
    recorded sampler logprob of each target (None where the target is a prompt token) and the
    sample requests used (for `touch`). ValidationError naming the datum and the sequence for
    the first claim that fails."""
    named = {
        _parse(span["sequence_id"])[0]
        for d in data
        for field in ("model_input", "targets")
        for span in (d.get("provenance") or {}).get(field, [])
    }
    found = _load(conn, principal, named) if named else {}
    checker = _Checker(session, found, ttl_seconds)
    resolved = [checker.datum(i, d) for i, d in enumerate(data)]
    return resolved, named


class _Checker:
    def __init__(
        self, session: SessionRow, found: Mapping[str, Recorded], ttl_seconds: float
    ) -> None:
        self.session = session
        self.found = found
        self.ttl_seconds = ttl_seconds

    def datum(self, i: int, d: Mapping[str, Any]) -> list[float | None]:
        provenance = d.get("provenance")
        if provenance is None:
            raise ValidationError(
                f"datum {i} has no provenance; stable_reinforce reads the sampler logprobs the "
                "platform recorded, so every datum must name the sequences it came from: "
                "sample with a sampling client created with record_stability_info=True and "
                "build the datum with Datum.with_provenance"
            )
        tokens: list[int] = d["tokens"]
        targets: list[int] = d["loss_fn_inputs"]["target_tokens"]["data"]
        self._tile(i, "model_input", provenance["model_input"], len(tokens))
        self._tile(i, "loss_fn_inputs", provenance["targets"], len(targets))
        self._claims(i, "model_input", provenance["model_input"], tokens)
        return self._claims(i, "target_tokens", provenance["targets"], targets)

    @staticmethod
    def _tile(i: int, field: str, spans: Sequence[Mapping[str, Any]], n: int) -> None:
        covered = sum(int(s["length"]) for s in spans)
        if covered != n:
            raise ValidationError(
                f"datum {i}: its {field} provenance spans cover {covered} positions but "
                f"{field} has {n}; the spans must tile it exactly (Datum.with_provenance)"
            )

    def _claims(
        self, i: int, field: str, spans: Sequence[Mapping[str, Any]], values: Sequence[int]
    ) -> list[float | None]:
        """Check that each span's positions of `values` are its sequence's recorded tokens;
        the recorded sampler logprob of each position (None for prompt positions)."""
        logprobs: list[float | None] = []
        at = 0
        for span in spans:
            sequence_id, offset, length = span["sequence_id"], span["offset"], span["length"]
            where = (
                f"datum {i}: {field} positions {at}..{at + length - 1} name sequence {sequence_id}"
            )
            source_tokens, source_logprobs = self._source(where, sequence_id, span["kind"])
            if offset + length > len(source_tokens):
                raise ValidationError(
                    f"{where} at offset {offset}, but its recorded {span['kind']} tokens are "
                    f"{len(source_tokens)} long"
                )
            recorded = source_tokens[offset : offset + length]
            given = list(values[at : at + length])
            if given != recorded:
                j = next(k for k, (a, b) in enumerate(zip(given, recorded, strict=True)) if a != b)
                raise ValidationError(
                    f"{where}, but position {at + j} holds token {given[j]} where the recorded "
                    f"sequence has {recorded[j]}; nothing was trained: send the tokens as they "
                    "were sampled"
                )
            if source_logprobs is None:
                logprobs.extend([None] * length)
            else:
                logprobs.extend(float(v) for v in source_logprobs[offset : offset + length])
            at += length
        return logprobs

    def _source(
        self, where: str, sequence_id: str, kind: str
    ) -> tuple[list[int], list[float] | None]:
        """The recorded tokens a span of `kind` reads (the request's prompt, or the sequence's
        sampled tokens with their logprobs)."""
        request_id, index_text = _parse(sequence_id)
        sample = self.found.get(request_id)
        if sample is None or not index_text.isdigit():
            raise ValidationError(
                f"{where}, which is not a recorded sequence: only sequences sampled by a "
                "sampling client created with record_stability_info=True are recorded (and "
                f"kept {self.ttl_seconds:.0f} s after their last use)"
            )
        if sample.is_expired:
            raise ValidationError(
                f"{where}, which expired at {sample.expires_at.isoformat()}: recorded sequences "
                f"are kept {self.ttl_seconds:.0f} s after their last use; sample again"
            )
        session = self.session
        is_own = sample.session_id == session.id or (
            sample.session_id is None and sample.client_session_id == session.client_session_id
        )
        if not is_own:
            owner = sample.session_id or f"client session {sample.client_session_id}"
            raise ValidationError(
                f"{where}, which was sampled from the weights of {owner}, not of this session "
                f"({session.id}); a datum may name only sequences sampled from its own "
                "session's weights"
            )
        index = int(index_text)
        if index >= sample.num_samples:
            raise ValidationError(
                f"{where}, but sample {request_id} returned {sample.num_samples} sequences"
            )
        if sample.status != OpStatus.COMPLETED or sample.result is None:
            raise ValidationError(
                f"{where}, whose sample has not completed ({sample.status}); train on it once "
                "its result has come back"
            )
        if kind == "prompt":
            return sample.prompt, None
        sequence = sample.result.sequences[index]
        return list(sequence.tokens), list(sequence.logprobs)


def touch(conn: sa.Connection, request_ids: set[str], *, ttl_seconds: float) -> None:
    """Mark the recorded samples used now (in the admission's transaction): each is kept
    `ttl_seconds` from now. One that expired since `resolve` read it refuses the request."""
    if not request_ids:
        return
    kept = conn.execute(
        sa.update(recorded_samples)
        .where(
            recorded_samples.c.request_id.in_(sorted(request_ids)),
            recorded_samples.c.expires_at > sa.func.now(),
        )
        .values(last_used_at=sa.func.now(), expires_at=_expiry(ttl_seconds))
        .returning(recorded_samples.c.request_id)
    ).scalars()
    gone = request_ids - set(kept)
    if gone:
        raise ValidationError(
            f"the recorded sequences of sample {sorted(gone)[0]} expired while this request was "
            "admitted; sample again"
        )


# An expired record is kept this much longer, so that naming it says "expired" rather than
# "not recorded"; it is refused all the same.
PURGE_GRACE_SECONDS = 3600


def purge_expired(conn: sa.Connection, limit: int = 1000) -> int:
    """Forget up to `limit` recorded samples expired more than PURGE_GRACE_SECONDS ago."""
    cutoff = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, PURGE_GRACE_SECONDS)
    expired = (
        sa.select(recorded_samples.c.request_id)
        .where(recorded_samples.c.expires_at <= cutoff)
        .limit(limit)
        .scalar_subquery()
    )
    deleted = conn.execute(
        sa.delete(recorded_samples).where(recorded_samples.c.request_id.in_(expired))
    )
    return deleted.rowcount or 0
