"""Replay and fork against the served platform (`treadle up`: API, real workers), through the
SDK users call: a fork at seq N holds exactly the weights and optimizer state a checkpoint of
the original run saved at N, and training it leaves the source alone; a replay verifies every
step, samples what the original sampled at that step, refuses training and bills nothing.

Weights are compared tensor by tensor, bit for bit (`torch.equal` on the saved safetensors).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import sqlalchemy as sa
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

import treadle
from tests.conftest import Platform
from tests.databases import private_database
from tests.integration.wire_client import datum
from treadle.client.admin import AdminClient
from treadle.engine import Engine
from treadle.platform import db
from treadle.platform.audit import lineage
from treadle.platform.checkpoints import storage
from treadle.platform.config import PlatformConfig
from treadle.platform.eventlog import schema
from treadle.platform.operations import commands
from treadle.platform.sessions import leases, routing
from treadle.platform.sessions import sessions as sessions_core
from treadle.platform.sessions.routing import make_celery
from treadle.platform.tenancy.tenants import Principal
from treadle.worker.host import SessionHost

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
PROMPT = [5, 9, 14, 3]
SAMPLING = types.SamplingParams(max_tokens=6, temperature=1.0, seed=1234)
STEPS = 7
FORK_STEP = 4  # the fork and the replay stand right after this step's checkpoint save


@dataclass(frozen=True)
class Source:
    platform: Platform
    key: str
    svc: treadle.ServiceClient
    tc: treadle.TrainingClient
    model_id: str
    seq_n: int  # the seq_id of the save_state after step FORK_STEP
    path_n: str  # the checkpoint the save at seq_n wrote
    end_path: str  # the checkpoint saved after the last step
    tokens_n: list[int]  # what a sampler on the weights then returned for PROMPT, SAMPLING
    last_seq: int
    db: sa.Engine


def _step(tc: treadle.TrainingClient, step: int) -> None:
    batch = [datum([1 + step, 7, 3, 9, 4]), datum([2, 8 + step, 5])]
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.02)).result()


def _seq_of_save(engine: sa.Engine, model_id: str, path: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT seq_id FROM operations WHERE session_id = :m AND type = 'save_weights'"
                    " AND result->>'path' = :p"
                ),
                {"m": model_id, "p": path},
            ).scalar_one()
        )


@pytest.fixture(scope="module")
def source(platform: Platform) -> Iterator[Source]:
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"lineage-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    engine = db.connect(platform.database_url, pool_size=1)
    svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
    tc = svc.create_lora_training_client(BASE_MODEL, rank=4, seed=11, training_session_name="src")
    path_n, tokens_n = "", []
    for step in range(STEPS):
        _step(tc, step)
        if step == FORK_STEP:
            path_n = tc.save_state("at-n").result().path
            sampler = tc.save_weights_and_get_sampling_client()
            result = sampler.sample(PROMPT, num_samples=1, sampling_params=SAMPLING).result()
            tokens_n = list(result.sequences[0].tokens)
    end_path = tc.save_state("end").result().path
    with engine.connect() as conn:
        last = conn.execute(
            sa.text("SELECT last_applied_seq FROM sessions WHERE id = :m"), {"m": tc.model_id}
        ).scalar_one()
    yield Source(
        platform=platform, key=key, svc=svc, tc=tc, model_id=tc.model_id,
        seq_n=_seq_of_save(engine, tc.model_id, path_n), path_n=path_n, end_path=end_path,
        tokens_n=tokens_n, last_seq=int(last), db=engine,
    )  # fmt: skip
    svc.close()
    engine.dispose()


def _tensors(svc: treadle.ServiceClient, path: str, folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: adapter weights and optimizer state, by file and name."""
    svc.checkpoints.download(path, folder)
    found = {
        f"{f.name}:{name}": tensor
        for f in sorted(folder.glob("*.safetensors"))
        for name, tensor in load_file(f).items()
    }
    assert any(k.startswith("adapter_model") for k in found), sorted(found)
    assert any(k.startswith("optimizer") for k in found), sorted(found)
    return found


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), f"{name} differs"


def _events(source: Source, model_id: str) -> list[tuple[int, str]]:
    with source.db.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT position, type FROM events WHERE session_id = :m ORDER BY seq"),
            {"m": model_id},
        )
        return [(int(r[0]), str(r[1])) for r in rows]


def test_a_fork_at_n_equals_the_checkpoint_the_run_saved_at_n(
    source: Source, tmp_path: Path
) -> None:
    fork = source.svc.fork_training_client(source.model_id, at_seq=source.seq_n)
    saved = fork.save_state("fork-at-n").result().path
    _assert_bit_identical(
        _tensors(source.svc, source.path_n, tmp_path / "original"),
        _tensors(source.svc, saved, tmp_path / "fork"),
    )
    head = _events(source, fork.model_id)[:2]
    assert [t for _, t in head] == ["SessionCreated", "SessionForked"]


def test_a_fork_before_n_differs_from_the_checkpoint_at_n(source: Source, tmp_path: Path) -> None:
    """The control of the test above: one optimizer step earlier, the weights differ."""
    fork = source.svc.fork_training_client(source.model_id, at_seq=source.seq_n - 2)
    saved = fork.save_state("fork-before-n").result().path
    at_n = _tensors(source.svc, source.path_n, tmp_path / "original")
    before = _tensors(source.svc, saved, tmp_path / "fork")
    assert any(not torch.equal(at_n[k], before[k]) for k in at_n if k.startswith("adapter"))


def test_training_a_fork_leaves_the_source_untouched(source: Source, tmp_path: Path) -> None:
    before = _events(source, source.model_id)
    fork = source.svc.fork_training_client(source.model_id, at_seq=source.last_seq)
    for step in range(2):
        _step(fork, 100 + step)
    assert _events(source, source.model_id) == before  # not one event more
    # The source's live weights: a save now equals the one it made at its end, bit for bit.
    fork_trained = fork.save_state("fork-trained").result().path
    again = source.tc.save_state("end-again").result().path
    original = _tensors(source.svc, source.end_path, tmp_path / "end")
    _assert_bit_identical(original, _tensors(source.svc, again, tmp_path / "again"))
    trained = _tensors(source.svc, fork_trained, tmp_path / "trained")
    assert any(not torch.equal(original[k], trained[k]) for k in original)  # it did train


def test_a_replay_matches_every_step_and_samples_what_the_original_sampled(
    source: Source,
) -> None:
    replay = source.svc.replay(source.model_id, to_seq=source.seq_n)
    report = replay.report
    assert report.matched, str(report)
    assert report.first_divergence is None
    with source.db.connect() as conn:
        changes = conn.execute(
            sa.text(
                "SELECT count(*) FROM operations WHERE session_id = :m AND sampler_id IS NULL "
                "AND status = 'completed' AND jsonb_typeof(state) = 'object' AND seq_id <= :n"
            ),
            {"m": source.model_id, "n": source.seq_n},
        ).scalar_one()
    assert report.verified == changes > 2 * FORK_STEP
    sampler = replay.training_client.save_weights_and_get_sampling_client()
    result = sampler.sample(PROMPT, num_samples=1, sampling_params=SAMPLING).result()
    assert list(result.sequences[0].tokens) == source.tokens_n


def test_a_stopped_session_replays_to_its_end_matching_every_step(source: Source) -> None:
    tc = source.svc.create_lora_training_client(BASE_MODEL, rank=4, seed=5)
    for step in range(3):
        _step(tc, step)
    model_id = tc.model_id
    tc.stop()
    report = source.svc.replay(model_id).report
    assert report.matched, str(report)
    assert (report.replayed, report.verified) == (7, 7)  # create_model + 3 x (fb + optim)


def test_a_replay_refuses_training_and_bills_nothing(source: Source) -> None:
    replay = source.svc.replay(source.model_id)
    assert replay.report.matched, str(replay.report)
    with pytest.raises(tinker.BadRequestError, match="read-only"):
        replay.training_client.forward_backward([datum([1, 2, 3])], "cross_entropy").result()
    sampler = replay.training_client.save_weights_and_get_sampling_client()
    sampler.sample(PROMPT, num_samples=1, sampling_params=SAMPLING).result()
    with source.db.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT count(*) FROM usage WHERE session_id = :m"),
            {"m": replay.training_client.model_id},
        ).scalar_one()
    assert rows == 0


def test_a_forks_rebuild_costs_nothing(source: Source) -> None:
    fork = source.svc.fork_training_client(source.model_id, at_seq=source.seq_n)
    with source.db.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT u.cost_micro_usd, u.prefill_tokens + u.sample_tokens + u.train_tokens "
                "FROM usage u JOIN operations o USING (request_id) "
                "WHERE o.session_id = :m AND o.seq_id = 0"
            ),
            {"m": fork.model_id},
        ).one()
    assert tuple(row) == (0, 0)


def test_another_tenants_session_cannot_be_forked_or_replayed(source: Source) -> None:
    admin = AdminClient(source.platform.base_url, source.platform.admin_key)
    other_key = admin.create_tenant(f"lineage-other-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    other = treadle.ServiceClient(base_url=source.platform.base_url, api_key=other_key)
    try:
        with pytest.raises(tinker.NotFoundError):
            other.fork_training_client(source.model_id, at_seq=1)
        with pytest.raises(tinker.NotFoundError):
            other.replay(source.model_id)
    finally:
        other.close()


def test_a_seq_the_source_never_reached_is_refused_saying_how_far_it_went(
    source: Source,
) -> None:
    with pytest.raises(tinker.BadRequestError, match=r"applied operations up to seq \d+"):
        source.svc.fork_training_client(source.model_id, at_seq=source.last_seq + 100)


# --- a replay of an altered copy of the log ----------------------------------------------------

COPIED = ("tenants", "client_sessions", "sessions", "events", "operations")


def _copy_session(
    src: sa.Engine,
    dst: sa.Engine,
    model_id: str,
    altered_seq: int | None = None,
    *,
    forget_pass_tokens: bool = False,
) -> None:
    """Copy a session's rows (its tenant, client session, session, events and operations) into
    another database, changing (when `altered_seq` is given) the first target token of the
    forward_backward at `altered_seq` in its logged request, and (with `forget_pass_tokens`)
    leaving the pass budget out of every forward_backward's stored result, as a log written
    before it was recorded would."""
    tables = {name: schema.metadata.tables[name] for name in COPIED}
    with src.connect() as conn:
        session = conn.execute(
            sa.select(tables["sessions"]).where(tables["sessions"].c.id == model_id)
        ).one()
        rows = {
            "tenants": [tables["tenants"].c.id == session.tenant_id],
            "client_sessions": [tables["client_sessions"].c.id == session.client_session_id],
            "sessions": [tables["sessions"].c.id == model_id],
            "events": [tables["events"].c.session_id == model_id],
            "operations": [tables["operations"].c.session_id == model_id],
        }
        copied = {
            name: [dict(r._mapping) for r in conn.execute(sa.select(tables[name]).where(*where))]
            for name, where in rows.items()
        }
    altered = 0
    for event in copied["events"]:
        data = event["data"]
        if event["type"] == "OperationRequested" and data["seq_id"] == altered_seq:
            assert data["type"] == "forward_backward"
            target = data["payload"]["data"][0]["loss_fn_inputs"]["target_tokens"]["data"]
            target[0] = (target[0] + 1) % 100
            altered += 1
        if forget_pass_tokens and event["type"] == "OperationCompleted":
            (data.get("result") or {}).pop("pass_tokens", None)
    assert altered == (altered_seq is not None)
    forgotten = 0
    for op in copied["operations"]:
        if op["type"] == "forward_backward":
            assert op["result"]["pass_tokens"] == 682  # the CPU's budget on the tiny model
            if forget_pass_tokens:
                del op["result"]["pass_tokens"]
                forgotten += 1
    assert forgotten == (STEPS if forget_pass_tokens else 0)
    with dst.begin() as conn:
        for name in COPIED:
            conn.execute(tables[name].insert(), copied[name])
        conn.execute(sa.text(
            "SELECT setval(pg_get_serial_sequence('events', 'position'), max(position)) FROM events"
        ))  # fmt: skip


@dataclass(frozen=True)
class Replayed:
    report: dict[str, Any]
    weights: dict[str, np.ndarray]  # the replay's adapter once rebuilt


def _replay_copy(
    source: Source,
    tmp_path: Path,
    *,
    altered_seq: int | None = None,
    forget_pass_tokens: bool = False,
    microbatch_tokens: int | None = None,
) -> Replayed:
    """A replay of a copy of the source (`_copy_session`), rebuilt by a worker in this process
    whose engine has `microbatch_tokens` as its pass budget (None: the CPU's, as the source's)."""
    with source.db.connect() as conn:
        actor, tenant = conn.execute(
            sa.text(
                "SELECT actor, tenant_id FROM events WHERE session_id = :m"
                " AND type = 'SessionCreated'"
            ),
            {"m": source.model_id},
        ).one()
    with private_database(source.platform.database_url, "treadle_altered") as url:
        copy = db.connect(url, pool_size=2)
        _copy_session(
            source.db, copy, source.model_id, altered_seq, forget_pass_tokens=forget_pass_tokens
        )
        config = PlatformConfig(
            database_url=url, redis_url=source.platform.redis_url, data_dir=tmp_path / "data"
        )
        broker = redis.Redis.from_url(config.redis_url)
        engine = Engine(
            cache_dir=config.cache_dir, device="cpu", microbatch_tokens=microbatch_tokens
        )
        host = SessionHost(
            db=copy, redis_client=broker, engine=engine,
            store=storage.store_from_config(config), worker_id="worker-altered", config=config,
        )  # fmt: skip
        with copy.begin() as conn:
            leases.heartbeat_worker(conn, "worker-altered", {})
            principal = Principal(actor, tenant, "member")
            client_session = sessions_core.create_client_session(conn, principal, [], {})
        deps = commands.Deps(db=copy, celery=make_celery(config.redis_url), redis=broker,
                             config=config)  # fmt: skip
        opened = lineage.open_replay(
            deps, principal, source_id=source.model_id, client_session_id=client_session,
            model_seq_id=0,
        )  # fmt: skip
        host.wake(opened.session_id, None)  # the worker of the copy, in this process
        with copy.connect() as conn:
            report = lineage.report(conn, principal, opened.session_id)
        broker.delete(routing.session_queue(opened.session_id))  # its unconsumed wake-up
        weights = {}
        if engine.has_adapter(opened.session_id):
            weights = engine.adapter_weights(opened.session_id)
        copy.dispose()
    return Replayed(report, weights)


def test_a_replay_names_the_operation_whose_logged_payload_was_altered(
    source: Source, tmp_path: Path
) -> None:
    with source.db.connect() as conn:
        fb_seqs = (
            conn.execute(
                sa.text(
                    "SELECT seq_id FROM operations WHERE session_id = :m AND type = 'forward_backward'"
                    " ORDER BY seq_id"
                ),
                {"m": source.model_id},
            )
            .scalars()
            .all()
        )
    altered = int(fb_seqs[2])
    report = _replay_copy(source, tmp_path, altered_seq=altered).report
    assert report["status"] == "diverged", report
    first = report["first_divergence"]
    assert (first["seq_id"], first["operation"], first["part"]) == (
        altered,
        "forward_backward",
        "grads",
    )
    assert first["recorded"] != first["replayed"]
    assert report["verified"] == report["replayed"] - 1  # everything before it matched


def test_a_replay_on_a_worker_with_another_pass_budget_runs_the_recorded_one(
    source: Source, tmp_path: Path
) -> None:
    """The source trained on workers whose pass budget is the CPU's (682 tokens: each step's two
    data in one pass); a worker configured with 4 tokens (one pass each, other bits:
    tests/unit/engine/test_pass_budget.py) rebuilds it with the budget each forward_backward
    recorded, matching every step, and ends with the weights the source saved, bit for bit."""
    replayed = _replay_copy(source, tmp_path, microbatch_tokens=4)
    assert replayed.report["status"] == "matched", replayed.report
    assert replayed.report["verified"] == replayed.report["replayed"] > 2 * STEPS
    end = _tensors(source.svc, source.end_path, tmp_path / "end")
    saved = {k.split(":", 1)[1]: v for k, v in end.items() if k.startswith("adapter_model")}
    assert saved.keys() == replayed.weights.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, torch.from_numpy(replayed.weights[name])), name


def test_without_the_recorded_budget_a_replay_on_another_budget_diverges(
    source: Source, tmp_path: Path
) -> None:
    """The same replay with the budget left out of the log (the engine's own, 4 tokens, runs
    instead): the first forward_backward's grads differ from the recorded ones. What recording
    the budget prevents, and the proof the test above could fail."""
    report = _replay_copy(source, tmp_path, forget_pass_tokens=True, microbatch_tokens=4).report
    assert report["status"] == "diverged", report
    first = report["first_divergence"]
    assert (first["operation"], first["part"]) == ("forward_backward", "grads"), first
    assert report["verified"] == 1  # create_model only


def _treadle(source: Source, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TREADLE_BASE_URL": source.platform.base_url,
        "TREADLE_API_KEY": source.key,
    }
    return subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_treadle_replay_prints_the_report_and_exits_0_when_every_step_matched(
    source: Source,
) -> None:
    done = _treadle(source, "replay", source.model_id, "--to-seq", str(source.seq_n), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "matched" and report["first_divergence"] is None
    assert report["to_seq"] == source.seq_n and report["verified"] > 2 * FORK_STEP


def test_treadle_fork_prints_the_fork_and_the_checkpoint_it_saved(
    source: Source, tmp_path: Path
) -> None:
    done = _treadle(
        source, "fork", source.model_id, "--at-seq", str(source.seq_n), "--save", "cli-fork",
        "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout)
    assert out["model_id"] != source.model_id and out["path"].endswith("/cli-fork")
    _assert_bit_identical(
        _tensors(source.svc, source.path_n, tmp_path / "original"),
        _tensors(source.svc, out["path"], tmp_path / "fork"),
    )


def test_treadle_fork_of_a_seq_never_reached_says_so_and_exits_2(source: Source) -> None:
    done = _treadle(source, "fork", source.model_id, "--at-seq", "999999")
    assert done.returncode == 2
    assert "applied operations up to seq" in done.stdout


def test_top_k_targets_and_kl_marked_steps_replay_matching(platform: Platform) -> None:
    """A step of top-K cross_entropy ([N, K] targets and weights) and one of ppo on a datum with
    provenance (its sampled targets, kept for the KL metric, in the logged payload) replay to
    the same weights."""
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(f"lineage-topk-{secrets.token_hex(3)}")["api_key"]
    admin.close()
    svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
    tc = svc.create_lora_training_client(BASE_MODEL, rank=4, seed=5)
    tokens = [3, 7, 11, 5, 9]
    top_k = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.asarray([[7, 2, 0]] * 5)),
            "weights": types.TensorData.from_numpy(np.asarray([[0.7, 0.3, 0.0]] * 5, np.float32)),
        },
    )
    rl = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": [7, 11, 5, 9, 4],
            "logprobs": [0.0, -2.0, -1.5, -3.0, -0.5],
            "advantages": [0.0, 1.0, -1.0, 0.5, 1.0],
        },
    ).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="r:0", length=5)],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="r:0", offset=1, length=1),
            types.SampledProvenanceSpan(sequence_id="r:0", length=4),
        ],
    )
    fb = tc.forward_backward([top_k], "cross_entropy").result()
    assert fb.loss_fn_outputs[0]["logprobs"].shape == [5, 3]
    tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
    fb = tc.forward_backward([rl], "ppo").result()
    assert fb.metrics["kl_sample_train/tokens:sum"] == 4
    tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
    model_id = tc.model_id
    tc.stop()
    report = svc.replay(model_id).report
    assert report.matched, str(report)
    assert (report.replayed, report.verified) == (5, 5)  # create_model + 2 x (fb + optim)
    svc.close()
