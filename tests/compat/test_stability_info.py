"""Recorded samples, provenance and `stable_reinforce`, through the plain tinker SDK as
tinker-cookbook 0.6 uses them: a sampling client created with record_stability_info=True records
its sequences; a datum built with Datum.with_provenance names them; the platform checks every
claim (same session, not expired, the recorded tokens) before anything trains, and
stable_reinforce weighs each sampled token by its ratio against the *recorded* sampler logprob,
whatever `logprobs` the client sends. Losses that do not read provenance ignore it.
"""

from __future__ import annotations

import datetime
import logging
import time

import numpy as np
import pytest
import sqlalchemy as sa
import tinker
from tinker import types

from tests.compat import users
from tests.conftest import Platform, new_tenant_key
from tests.served_app import replica
from treadle.platform import db
from treadle.platform.eventlog.schema import recorded_samples
from treadle.platform.operations import recorded_samples as recorded_samples_core

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
PROMPT = [5, 17, 42, 8, 99]
ADVANTAGE = 0.75
SHORT_TTL_SECONDS = 1.0


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    return new_tenant_key(platform, "stability")


@pytest.fixture(scope="module")
def service(platform: Platform, key: str):  # type: ignore[no-untyped-def]
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    yield svc
    svc.close("success").result()


@pytest.fixture(scope="module")
def training(service: tinker.ServiceClient) -> tinker.TrainingClient:
    return service.create_lora_training_client(BASE_MODEL, rank=4, seed=3).result()


def sampled(sampler: tinker.SamplingClient, seed: int) -> types.SampledSequence:
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed, stop=[])
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result()
    (sequence,) = result.sequences
    assert sequence.sequence_id and len(sequence.tokens) == 6
    return sequence


def provenance_datum(
    sequence: types.SampledSequence, *, client_logprobs: float = 0.0, tamper: bool = False
) -> types.Datum:
    """The cookbook's datum of PROMPT + `sequence`, sampled targets with ADVANTAGE."""
    return users.provenance_datum(
        PROMPT, sequence, ADVANTAGE, client_logprobs=client_logprobs, tamper=tamper
    )


def expiry_of(platform: Platform, sequence: types.SampledSequence) -> datetime.datetime | None:
    """When the record of `sequence`'s sample expires (None: there is no record)."""
    request_id = str(sequence.sequence_id).rpartition(":")[0]
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            return conn.execute(
                sa.select(recorded_samples.c.expires_at).where(
                    recorded_samples.c.request_id == request_id
                )
            ).scalar_one_or_none()
    finally:
        engine.dispose()


def forward_backward_count(platform: Platform, model_id: str) -> int:
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM operations WHERE session_id = :s "
                        "AND type = 'forward_backward'"
                    ),
                    {"s": model_id},
                ).scalar_one()
            )
    finally:
        engine.dispose()


def test_stable_reinforce_weighs_sampled_tokens_by_the_recorded_sampler_logprobs(
    training: tinker.TrainingClient,
) -> None:
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequence = sampled(sampler, seed=1)
    assert sequence.logprobs is not None
    # The client claims sampler logprobs of 0.0 everywhere; the platform reads its own record.
    datum = provenance_datum(sequence, client_logprobs=0.0)

    out = training.forward_backward([datum], "stable_reinforce").result()

    lp = np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), np.float64)
    sampled_lp = lp[len(PROMPT) - 1 :]
    ratio = np.exp(sampled_lp - np.asarray(sequence.logprobs, np.float64))
    np.testing.assert_allclose(ratio, 1.0, atol=1e-3)  # on-policy: the sampler's weights
    expected = -np.sum(np.minimum(ratio, 2.0) * ADVANTAGE * sampled_lp)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    # with the client's logprobs (0.0) the weights would have been exp(lp) instead
    claimed = -np.sum(np.exp(sampled_lp) * ADVANTAGE * sampled_lp)
    assert abs(claimed - expected) > 1e-3


def test_a_datum_naming_another_sessions_sequence_is_refused_and_not_trained(
    platform: Platform, service: tinker.ServiceClient, training: tinker.TrainingClient
) -> None:
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequence = sampled(sampler, seed=2)
    other = service.create_lora_training_client(BASE_MODEL, rank=4).result()

    with pytest.raises(tinker.BadRequestError, match=r"datum 0: .*" + sequence.sequence_id):
        other.forward_backward([provenance_datum(sequence)], "stable_reinforce").result()

    assert forward_backward_count(platform, other.model_id) == 0
    # the session goes on: its next operation runs at once
    other.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_altered_tokens_are_refused_naming_the_datum(
    platform: Platform, training: tinker.TrainingClient
) -> None:
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequence = sampled(sampler, seed=3)
    before = forward_backward_count(platform, training.model_id)
    with pytest.raises(tinker.BadRequestError, match=r"datum 1: .* holds token"):
        training.forward_backward(
            [provenance_datum(sequence), provenance_datum(sequence, tamper=True)],
            "stable_reinforce",
        ).result()
    assert forward_backward_count(platform, training.model_id) == before


def test_an_unrecorded_sequence_or_no_provenance_is_refused(
    training: tinker.TrainingClient,
) -> None:
    sampler = training.save_weights_and_get_sampling_client().result()  # records nothing
    sequence = sampled(sampler, seed=4)
    with pytest.raises(tinker.BadRequestError, match="not a recorded sequence"):
        training.forward_backward([provenance_datum(sequence)], "stable_reinforce").result()
    bare = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "advantages": [1.0] * 4},
    )
    with pytest.raises(tinker.BadRequestError, match="datum 0 has no provenance"):
        training.forward_backward([bare], "stable_reinforce").result()


def test_other_losses_ignore_provenance(training: tinker.TrainingClient) -> None:
    """The cookbook attaches provenance to every RL datum, recorded or not."""
    sampler = training.save_weights_and_get_sampling_client().result()
    datum = provenance_datum(sampled(sampler, seed=5), client_logprobs=-1.0)
    out = training.forward_backward([datum], "importance_sampling").result()
    assert np.isfinite(out.metrics["loss:sum"])


def test_a_base_model_samplers_sequences_serve_its_client_sessions_training(
    service: tinker.ServiceClient, training: tinker.TrainingClient
) -> None:
    sampler = service.create_sampling_client(
        base_model=BASE_MODEL, record_stability_info=True
    ).result()
    sequence = sampled(sampler, seed=6)
    out = training.forward_backward([provenance_datum(sequence)], "stable_reinforce").result()
    assert np.isfinite(out.metrics["loss:sum"])


def test_a_use_keeps_a_record_a_time_to_live_longer(
    platform: Platform, training: tinker.TrainingClient
) -> None:
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequence = sampled(sampler, seed=8)
    recorded = expiry_of(platform, sequence)
    assert recorded is not None
    training.forward_backward([provenance_datum(sequence)], "stable_reinforce").result()
    used = expiry_of(platform, sequence)
    assert used is not None and used > recorded


def test_an_expired_record_is_purged_an_hour_after_it_expired(
    platform: Platform, training: tinker.TrainingClient
) -> None:
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequence = sampled(sampler, seed=9)
    request_id = str(sequence.sequence_id).rpartition(":")[0]
    aged = sa.update(recorded_samples).where(recorded_samples.c.request_id == request_id)
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.begin() as conn:
            conn.execute(aged.values(expires_at=sa.text("now() - interval '59 minutes'")))
            recorded_samples_core.purge_expired(conn)
        assert expiry_of(platform, sequence) is not None  # expired, still named as such
        with engine.begin() as conn:
            conn.execute(aged.values(expires_at=sa.text("now() - interval '61 minutes'")))
            assert recorded_samples_core.purge_expired(conn) >= 1
    finally:
        engine.dispose()
    assert expiry_of(platform, sequence) is None
    with pytest.raises(tinker.BadRequestError, match="not a recorded sequence"):
        training.forward_backward([provenance_datum(sequence)], "stable_reinforce").result()


def test_recorded_sequences_expire_after_their_time_to_live(
    platform: Platform, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="treadle.platform.operations.recorded_samples")
    with replica(platform, recorded_sample_ttl_seconds=SHORT_TTL_SECONDS) as (base_url, _):
        svc = tinker.ServiceClient(base_url=base_url, api_key=key)
        try:
            tc = svc.create_lora_training_client(BASE_MODEL, rank=4).result()
            sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
            sequence = sampled(sampler, seed=7)
            request_id = str(sequence.sequence_id).rpartition(":")[0]
            # the log says what was recorded (this replica's API runs in this process)
            assert any(
                f"recording the 1 sequences of sample {request_id} for {tc.model_id}" in m
                for m in caplog.messages
            )
            time.sleep(SHORT_TTL_SECONDS + 1.0)
            with pytest.raises(tinker.BadRequestError, match=r"datum 0: .* expired at"):
                tc.forward_backward([provenance_datum(sequence)], "stable_reinforce").result()
            assert forward_backward_count(platform, tc.model_id) == 0
        finally:
            svc.close("success").result()
