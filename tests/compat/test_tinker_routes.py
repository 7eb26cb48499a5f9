"""The rest of the Tinker surface against the served platform (`treadle up`, real workers), with
the official tinker SDK and its CLI (`python -m tinker.cli`, pointed at Treadle by
TINKER_BASE_URL / TINKER_API_KEY) and two tenants of this module's own: listing runs and
checkpoints, publishing (another tenant may read and load) and unpublishing (404 again), deleting,
copying (a loadable copy with its own files), exporting external weights and downloading them
(SDK links and `tinker checkpoint download`), cancelling futures (pending: the next operation runs
at once; running: stopped, with no trace in the weights), retrieve_futures, sessions' projects and
the CLI's key routes. Responses are validated
with the SDK's own pydantic types."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import tinker
from tinker import types
from tinker.cli.auth_api import SelfApiKeyResponse

from tests.conftest import Platform
from tests.integration.wire_client import WireClient, datum
from treadle.client.admin import AdminClient
from treadle.platform import db

pytestmark = [pytest.mark.integration, pytest.mark.compat]

BASE_MODEL = "treadle/tiny-debug"
TOKENS = [5, 17, 29, 3, 11, 40, 2]
ADAPTER = "adapter_model.safetensors"


@dataclass
class World:
    platform: Platform
    owner: str  # tenant ids and their admin keys
    owner_key: str
    other: str
    other_key: str
    service: tinker.ServiceClient  # the owner's
    training: tinker.TrainingClient  # the owner's model, trained one step
    model_id: str  # its id
    shared: str  # its checkpoint tinker://<model>/weights/shared

    def rest(self, key: str | None = None) -> tinker.RestClient:
        return tinker.RestClient(base_url=self.platform.base_url, api_key=key or self.owner_key)

    def http(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.platform.base_url,
            headers={"X-API-Key": key or self.owner_key},
            timeout=60,
        )

    def file(self, path: str, key: str | None = None, name: str = ADAPTER) -> bytes:
        """A checkpoint's file through Treadle's own download route."""
        with self.http(key) as http:
            r = http.get("/api/v1/treadle/checkpoints/file", params={"path": path, "name": name})
        assert r.status_code == 200, r.text
        return r.content

    def cli(self, *args: str, key: str | None = None) -> Any:
        """Run the official CLI with `-f json`; its parsed output (None when it prints none)."""
        done = self.run_cli("-f", "json", *args, env={"TINKER_API_KEY": key or self.owner_key})
        return json.loads(done.stdout) if done.stdout.strip() else None

    def run_cli(
        self, *args: str, env: dict[str, str], stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the official CLI (exit 0 expected) with `env` over this process's environment."""
        base = {k: v for k, v in os.environ.items() if k != "TINKER_API_KEY"}
        done = subprocess.run(
            [sys.executable, "-m", "tinker.cli", *args],
            env={**base, "TINKER_BASE_URL": self.platform.base_url, "TINKER_TELEMETRY": "0",
                 **env},
            input=stdin,
            capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, f"tinker {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done


@pytest.fixture(scope="module")
def world(platform: Platform) -> Iterator[World]:
    suffix = secrets.token_hex(3)
    admin = AdminClient(platform.base_url, platform.admin_key)
    owner, other = f"routes-owner-{suffix}", f"routes-other-{suffix}"
    owner_key = admin.create_tenant(owner)["api_key"]
    other_key = admin.create_tenant(other)["api_key"]
    admin.close()
    service = tinker.ServiceClient(base_url=platform.base_url, api_key=owner_key)
    training = service.create_lora_training_client(BASE_MODEL, rank=4, seed=1).result()
    training.forward_backward([datum(TOKENS)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    shared = training.save_state("shared").result().path
    model_id = training.get_info().model_id
    yield World(platform, owner, owner_key, other, other_key, service, training, model_id, shared)
    service.close("success").result()


@dataclass
class Wire:
    """A model and a sampler of the owner driven by raw requests, to control seq_ids and read
    request ids."""

    client: WireClient
    model_id: str
    sampler: str
    next_seq: int
    next_sample_seq: int = 0

    def seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1

    def sample(self, num_samples: int = 1, max_tokens: int = 4) -> str:
        seq, self.next_sample_seq = self.next_sample_seq, self.next_sample_seq + 1
        r = self.client.post(
            "asample",
            {"sampling_session_id": self.sampler, "seq_id": seq, "num_samples": num_samples,
             "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
             "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": 3,
                                 "stop": []}},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        return str(r.json()["request_id"])


@pytest.fixture(scope="module")
def wire(world: World) -> Iterator[Wire]:
    client = WireClient(world.platform.base_url, world.owner_key)
    model_id = client.create_model(BASE_MODEL, rank=4)
    r = client.post(
        "save_weights_for_sampler",
        {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0},
    )
    sampler = client.result(r.json()["request_id"])["sampling_session_id"]
    yield Wire(client, model_id, sampler, next_seq=2)
    client.http.close()


def _reservations(world: World, request_id: str) -> int:
    engine = db.connect(world.platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT count(*) FROM reservations WHERE request_id = :r"),
                    {"r": request_id},
                ).scalar_one()
            )
    finally:
        engine.dispose()


# --- the CLI's registry commands -----------------------------------------------------------


def test_cli_lists_runs_and_checkpoints_as_json(world: World) -> None:
    runs = world.cli("run", "list")
    assert world.model_id in json.dumps(runs)
    listed = world.cli("checkpoint", "list")["checkpoints"]
    by_run = world.cli("checkpoint", "list", "--run-id", world.model_id)["checkpoints"]
    for checkpoints in (listed, by_run):
        shared = [types.Checkpoint.model_validate(c) for c in checkpoints if
                  c["tinker_path"] == world.shared]  # fmt: skip
        assert len(shared) == 1 and shared[0].checkpoint_type == "training"


def test_cli_deletes_a_checkpoint(world: World) -> None:
    doomed = world.training.save_state("doomed").result().path
    world.cli("checkpoint", "delete", doomed, "--yes")
    left = world.cli("checkpoint", "list", "--run-id", world.model_id)["checkpoints"]
    assert doomed not in [c["tinker_path"] for c in left]
    assert world.shared in [c["tinker_path"] for c in left]


# --- publishing ----------------------------------------------------------------------------


def test_publish_lets_another_tenant_load_it_and_unpublish_takes_it_back(world: World) -> None:
    other = world.rest(world.other_key)
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(world.shared).result()

    world.cli("checkpoint", "publish", world.shared)
    world.cli("checkpoint", "publish", world.shared)  # again: nothing changes, still a success
    listed = world.cli("checkpoint", "list", "--run-id", world.model_id)["checkpoints"]
    assert [c["public"] for c in listed if c["tinker_path"] == world.shared] == [True]
    info = other.get_weights_info_by_tinker_path(world.shared).result()
    assert info.base_model == BASE_MODEL and info.lora_rank == 4

    with tinker.ServiceClient(base_url=world.platform.base_url, api_key=world.other_key) as svc:
        loaded = svc.create_training_client_from_state(world.shared).result()
        mine = loaded.save_state("loaded").result().path
        # The other tenant's model holds exactly the published weights.
        assert world.file(mine, world.other_key) == world.file(world.shared)
        run = other.get_training_run(loaded.get_info().model_id).result()
        assert run.model_owner == world.other and run.base_model == BASE_MODEL
        sampler = svc.create_sampling_client(model_path=world.shared).result()  # sampled too
        prompt = tinker.types.ModelInput.from_ints([1, 2, 3])
        assert len(sampler.compute_logprobs(prompt).result()) == 3

    world.cli("checkpoint", "unpublish", world.shared)
    world.cli("checkpoint", "unpublish", world.shared)
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(world.shared).result()
    with world.http(world.other_key) as http:
        assert http.post(
            "/api/v1/create_sampling_session",
            json={"session_id": "sess-0000000000000000", "sampling_session_seq_id": 0,
                  "model_path": world.shared},
        ).status_code == 404  # fmt: skip
        refused = http.post(
            "/api/v1/load_weights",
            json={"path": world.shared, "session_id": "sess-0000000000000000", "model_seq_id": 0},
        )
        assert refused.status_code == 404, refused.text
        assert http.post(  # nor may it publish, unpublish or delete another tenant's
            f"/api/v1/training_runs/{world.model_id}/checkpoints/weights/shared/publish"
        ).status_code == 404  # fmt: skip


# --- copies ----------------------------------------------------------------------------------


def test_copy_weights_makes_a_loadable_copy_with_its_own_files(world: World) -> None:
    source = world.training.save_state("to-copy").result().path
    rest = world.rest()
    copied = rest.copy_weights(source, world.owner).result()
    assert copied != source and copied.endswith("/weights/to-copy")
    assert world.file(copied) == world.file(source)
    rest.delete_checkpoint_from_tinker_path(source).result()
    # The copy keeps its own files after the source is gone, and loads.
    assert len(world.file(copied)) > 0
    loaded = world.service.create_training_client_from_state_with_optimizer(copied).result()
    loss = loaded.forward([datum(TOKENS)], "cross_entropy").result()
    assert loss.metrics["loss:sum"] > 0
    # The copy's run holds checkpoints only: it cannot be trained on.
    copy_run = copied.removeprefix("tinker://").split("/")[0]
    with world.http() as http:
        refused = http.post(
            "/api/v1/optim_step", json={"model_id": copy_run, "seq_id": 1, "adam_params": {}}
        )
        assert refused.status_code == 400 and "Stopped" in refused.text, refused.text


def test_a_resent_copy_answers_the_first_and_another_project_is_refused(world: World) -> None:
    body = {"source_path": world.shared, "destination_project_id": world.owner}
    with world.http() as http:
        first, again, other = (
            http.post("/api/v1/copy_weights", json=body, headers={"X-Idempotency-Key": key})
            for key in ("copy-key-1", "copy-key-1", "copy-key-2")
        )
        paths = [types.CopyWeightsResponse.model_validate(r.json()).tinker_path
                 for r in (first, again, other)]  # fmt: skip
        assert paths[0] == paths[1] != paths[2]
        refused = http.post(
            "/api/v1/copy_weights",
            json={"source_path": world.shared, "destination_project_id": "elsewhere"},
        )
        assert refused.status_code == 400 and world.owner in refused.text, refused.text


# --- external weights --------------------------------------------------------------------------


def test_external_weights_download_through_the_sdk_links_and_the_cli(
    world: World, tmp_path: Path
) -> None:
    exported = world.training.save_weights_external("export").result().path
    assert exported == f"tinker://{world.model_id}/external_weights/export"
    links = world.rest().get_external_weights_urls(exported).result()
    assert {ADAPTER, "adapter_config.json"} <= set(links.urls)
    keyless = httpx.get(links.urls[ADAPTER], timeout=60)  # no API key: the token is the key
    assert keyless.status_code == 200
    assert keyless.content == world.file(exported) == world.file(world.shared)
    assert httpx.get(links.urls[ADAPTER] + "x", timeout=60).status_code == 404

    refused = world.training.save_weights_external("sealed", age_encryption_recipients=["age1x"])
    with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
        refused.result()

    # Another tenant's links work while it is published, and end when it is unpublished.
    world.cli("checkpoint", "publish", exported)
    theirs = world.rest(world.other_key).get_external_weights_urls(exported).result()
    assert httpx.get(theirs.urls[ADAPTER], timeout=60).status_code == 200
    world.cli("checkpoint", "unpublish", exported)
    assert httpx.get(theirs.urls[ADAPTER], timeout=60).status_code == 404
    assert httpx.get(links.urls[ADAPTER], timeout=60).status_code == 200  # the owner's still

    out = world.cli("checkpoint", "download", world.shared, "--output", str(tmp_path))
    folder = Path(out["destination"])
    assert (folder / ADAPTER).read_bytes() == world.file(world.shared)
    assert (folder / "adapter_config.json").exists()
    left = world.cli("checkpoint", "list")["checkpoints"]
    assert [c for c in left if c["tinker_path"].endswith("/external_weights/download")] == []


# --- futures ------------------------------------------------------------------------------------


def test_cancelling_a_pending_op_fails_it_and_the_next_op_runs_at_once(
    world: World, wire: Wire
) -> None:
    # A long sample keeps the session's worker busy, so the operations behind it stay pending.
    long_sample = wire.sample(num_samples=128, max_tokens=2000)
    time.sleep(1.0)
    pending = wire.client.forward_backward(wire.model_id, wire.seq(), [datum(TOKENS)])
    after = wire.client.forward_backward(wire.model_id, wire.seq(), [datum(TOKENS)])
    pending_id, after_id = pending.json()["request_id"], after.json()["request_id"]
    assert _reservations(world, pending_id) == 1

    cancelled = wire.client.post("cancel_future", {"request_id": pending_id})
    assert cancelled.status_code == 200, cancelled.text
    assert wire.client.result(pending_id) == {"error": "cancelled", "category": "user"}
    assert _reservations(world, pending_id) == 0

    started = time.monotonic()  # the running sample stops at its next step boundary
    assert wire.client.post("cancel_future", {"request_id": long_sample}).status_code == 200
    assert wire.client.result(long_sample) == {"error": "cancelled", "category": "user"}
    result = wire.client.result(after_id, timeout=30)  # the gap timeout is 60 s
    assert result.metrics["loss:sum"] > 0
    assert time.monotonic() - started < 20

    again = wire.client.post("cancel_future", {"request_id": after_id})
    assert again.status_code == 400 and "completed" in again.text, again.text
    with world.http(world.other_key) as http:  # another tenant's request is a missing one
        assert http.post("/api/v1/cancel_future", json={"request_id": after_id}).status_code == 404


def test_a_cancelled_running_op_leaves_no_trace_in_the_weights(world: World) -> None:
    """A forward_backward cancelled while it runs is dropped (stopped at its next microbatch,
    if it has one left), and the model goes on exactly as if it had never been sent: after the
    same later steps its loss equals that of a twin model that never got it. (One microbatch of
    this one takes seconds on a CPU; the running sample above shows the stop between steps.)"""
    client = WireClient(world.platform.base_url, world.owner_key)
    cancelled = client.create_model(BASE_MODEL, rank=4)
    twin = client.create_model(BASE_MODEL, rank=4)
    # many parts, so that it is still running when the cancel comes, however fast this machine
    long_ones = [datum([(7 * i + j) % 97 + 1 for j in range(1500)]) for i in range(8)]
    losses = []
    for model_id in (cancelled, twin):
        seq = 1
        client.result(client.forward_backward(model_id, seq, [datum(TOKENS)]).json()["request_id"])
        if model_id == cancelled:
            seq += 1
            running = client.forward_backward(model_id, seq, long_ones).json()["request_id"]
            time.sleep(1.5)  # it runs now
            assert client.post("cancel_future", {"request_id": running}).status_code == 200
            assert client.result(running) == {"error": "cancelled", "category": "user"}
        client.result(client.optim_step(model_id, seq + 1).json()["request_id"])
        forward = client.forward_backward(model_id, seq + 2, [datum(TOKENS)])
        losses.append(client.result(forward.json()["request_id"]).metrics["loss:sum"])
    # It had run: what it did to the adapter was dropped, and the model rebuilt from its log.
    recovered = client.http.get(
        f"/api/v1/treadle/sessions/{cancelled}/events", params={"type": "SessionRecovered"}
    ).json()["events"]
    client.http.close()
    assert losses[0] == losses[1]
    assert len(recovered) == 1


def test_retrieve_futures_returns_every_result_of_the_client(world: World, wire: Wire) -> None:
    sent = [wire.sample() for _ in range(3)]
    for request_id in sent:
        wire.client.result(request_id)
    target = {"sampling_session_id": wire.sampler, "cloned_sampler_id": 0}
    first = types.FuturesRetrieveResponse.model_validate(
        wire.client.post("retrieve_futures", {"target": target, "timeout": 0}).json()
    )
    finished = {c.request_id for c in first.completions if c.state == "finished"}
    assert set(sent) <= finished
    # Nothing new after the cursor; a request sent now comes back from the long poll.
    idle = wire.client.post(
        "retrieve_futures", {"target": target, "prev_cursor": first.cursor, "timeout": 0}
    ).json()
    assert idle == {"completions": [], "cursor": first.cursor}
    late = wire.sample()
    polled = types.FuturesRetrieveResponse.model_validate(
        wire.client.post("retrieve_futures", {"target": target, "prev_cursor": first.cursor}).json()
    )
    assert [c.request_id for c in polled.completions] == [late] and polled.cursor > first.cursor
    joined = [
        types.JoinSamplingSessionResponse.model_validate(
            wire.client.post("join_sampling_session", {"sampling_session_id": wire.sampler}).json()
        ).client_counter
        for _ in range(2)
    ]
    assert joined == [1, 2]


# --- sessions and keys --------------------------------------------------------------------------


def test_a_session_goes_into_its_tenants_project_only(world: World) -> None:
    rest = world.rest()
    session_id = rest.list_sessions().result().sessions[0]
    rest.assign_session_project(session_id, world.owner).result()
    with pytest.raises(tinker.BadRequestError, match=world.owner):
        rest.assign_session_project(session_id, "another-project").result()
    with pytest.raises(tinker.NotFoundError):
        world.rest(world.other_key).assign_session_project(session_id, world.other).result()


def test_the_cli_key_routes_describe_and_revoke_the_presented_key(
    world: World, tmp_path: Path
) -> None:
    admin = AdminClient(world.platform.base_url, world.owner_key)
    member_key = admin.create_key(role="member", name="laptop")["api_key"]
    admin.close()
    home = {"HOME": str(tmp_path)}  # `tinker auth login` stores the key in ~/.tinker
    world.run_cli("auth", "login", env=home, stdin=member_key + "\n")
    stored = json.loads((tmp_path / ".tinker" / "credentials.json").read_text())
    assert member_key in json.dumps(stored)
    assert "accessible: yes" in world.run_cli("auth", "status", env=home).stdout
    world.run_cli("auth", "logout", env=home)
    with world.http(member_key) as http:
        me = SelfApiKeyResponse.model_validate(http.get("/api/v1/auth/apikey/me").json())
        assert me.name == "laptop" and me.details.org_details.name == world.owner
        assert http.delete("/api/v1/auth/apikey/me").status_code == 200
        time.sleep(1.5)  # the API's key cache lasts a second
        assert http.get("/api/v1/auth/apikey/me").status_code == 401
