"""Placement by memory against a real PostgreSQL (treadle/platform/sessions/leases.py with
admission.py): a new session goes to a worker with room for it even when another has fewer
sessions, a worker claims only a session it has room for, a worker whose heartbeat reports no
budget is judged as before, a create no live worker has room for is a ValidationError naming
the numbers, and two creates at once cannot both take a worker's last room. Each test runs in a transaction it rolls back, with the workers table emptied in it,
so heartbeats of other tests' workers do not take part."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from treadle.platform.config import PlatformConfig
from treadle.platform.errors import ValidationError
from treadle.platform.operations.commands import require_host
from treadle.platform.sessions import admission, leases, sessions
from treadle.platform.tenancy import tenants

pytestmark = pytest.mark.integration

MiB = 2**20
MODEL = "treadle/tiny-debug"
FOOTPRINT = {
    "weight_bytes": 10 * MiB,
    "lora_per_rank": {"attn": 1000, "mlp": 3000, "unembed": 50_000},
    "pass_bytes": 4 * MiB,
    "kv_bytes": 2 * MiB,
}
PRINCIPAL = tenants.Principal("key-admission", "admission", "admin")


def _info(capacity: int) -> dict[str, Any]:
    return {
        "models": [MODEL],
        "refused": {},
        "budget": {"capacity_bytes": capacity, "resident_adapters": 0},
        "footprints": {MODEL: FOOTPRINT},
    }


@pytest.fixture
def conn(quiet_engine: sa.Engine) -> Iterator[sa.Connection]:
    with quiet_engine.connect() as connection:
        tx = connection.begin()
        try:
            connection.execute(sa.text("DELETE FROM workers"))
            tenants.ensure_tenant(connection, PRINCIPAL.tenant_id)
            yield connection
        finally:
            tx.rollback()


def _session(conn: sa.Connection, rank: int) -> admission.Held:
    client = sessions.create_client_session(conn, PRINCIPAL, [], {})
    sid = sessions.training_session_id(client, 0)
    lora = {"rank": rank, "alpha": 32.0}
    sessions.create_session(
        conn, PRINCIPAL, session_id=sid, client_session_id=client, kind="training",
        base_model=MODEL, lora_config=lora,
    )  # fmt: skip
    return admission.Held(sid, MODEL, "training", lora)


def test_a_session_goes_to_the_worker_with_room_not_the_least_loaded(
    conn: sa.Connection,
) -> None:
    leases.heartbeat_worker(conn, "w-a-small", _info(20 * MiB))
    leases.heartbeat_worker(conn, "w-b-big", _info(200 * MiB))
    for _ in range(2):  # the big one holds two sessions, the small one none
        held = _session(conn, 1)
        assert leases.lease_session(conn, held.session_id, "w-b-big", only_if_unleased=True)
    new = _session(conn, 64)  # 64 x 54,000 x 16 bytes = 52.7 MiB: only the big one has room
    assert leases.place_session(conn, new.session_id, 10.0, MODEL, new) == "w-b-big"
    small = _session(conn, 1)  # the small one has room for this, and fewer sessions
    assert leases.place_session(conn, small.session_id, 10.0, MODEL, small) == "w-a-small"


def test_a_worker_claims_only_a_session_it_has_room_for(conn: sa.Connection) -> None:
    leases.heartbeat_worker(conn, "w-small", _info(20 * MiB))
    assert leases.has_room_for(conn, "w-small", _session(conn, 1).session_id)
    assert not leases.has_room_for(conn, "w-small", _session(conn, 64).session_id)


def test_a_worker_that_reports_no_budget_is_judged_as_before(conn: sa.Connection) -> None:
    leases.heartbeat_worker(conn, "w-old", {"models": [MODEL], "refused": {}})
    new = _session(conn, 128)
    assert leases.place_session(conn, new.session_id, 10.0, MODEL, new) == "w-old"


def test_a_create_no_live_worker_has_room_for_names_the_numbers(conn: sa.Connection) -> None:
    leases.heartbeat_worker(conn, "w-small", _info(20 * MiB))
    config = PlatformConfig()
    need = admission.Held("new", MODEL, "training", {"rank": 64, "alpha": 32.0})
    with pytest.raises(ValidationError) as refused:
        require_host(conn, config, MODEL, need)
    message = str(refused.value)
    assert (
        "no live worker has the memory for a rank-64 LoRA session on treadle/tiny-debug" in message
    )
    assert "(3,456,000 LoRA parameters x 16 bytes = 52.73 MiB" in message
    assert "w-small has 20.00 MiB per device" in message
    assert "Lower the rank, train fewer targets" in message
    require_host(conn, config, MODEL, admission.Held("new", MODEL, "training", {"rank": 1}))


def test_two_creates_at_once_cannot_both_take_the_last_room(quiet_engine: sa.Engine) -> None:
    """Two creates checking one worker's room at the same moment: the first to read it holds the
    placement lock until its transaction ends (`leases.with_room`), so the second reads the room
    only after the first's session is placed, and is refused. With the lock taken out (seen),
    the second was placed meanwhile and the first, admitted on the room it had read, found none
    left to place it; had both read the room before either placed, both would have been
    placed, over the worker's memory."""
    tag = uuid.uuid4().hex[:8]
    model, worker = f"race/{tag}", f"w-race-{tag}"
    info = {**_info(130 * MiB), "models": [model], "footprints": {model: FOOTPRINT}}
    lora = {"rank": 64, "alpha": 32.0}  # about 108 MiB with its working set: room for one
    with quiet_engine.begin() as setup:
        tenants.ensure_tenant(setup, PRINCIPAL.tenant_id)
        leases.heartbeat_worker(setup, worker, info)
        client = sessions.create_client_session(setup, PRINCIPAL, [], {})
    config = PlatformConfig()
    first_checked, second_done = threading.Event(), threading.Event()
    outcome: dict[int, str] = {}

    def create(index: int) -> None:
        sid = sessions.training_session_id(client, index)
        need = admission.Held(sid, model, "training", lora)
        try:
            with quiet_engine.begin() as conn:
                require_host(conn, config, model, need)
                if index == 0:  # the first waits here, its check done, for the second
                    first_checked.set()
                    second_done.wait(3.0)  # the second cannot finish while this holds the lock
                sessions.create_session(
                    conn, PRINCIPAL, session_id=sid, client_session_id=client,
                    kind="training", base_model=model, lora_config=lora,
                )  # fmt: skip
                placed = leases.place_session(conn, sid, config.lease_ttl_seconds, model, need)
                outcome[index] = f"placed on {placed}"
        except ValidationError as exc:
            outcome[index] = f"refused: {exc}"
        finally:
            if index == 1:
                second_done.set()

    first = threading.Thread(target=create, args=(0,))
    first.start()
    assert first_checked.wait(10.0), outcome
    second = threading.Thread(target=create, args=(1,))
    second.start()
    first.join(30.0)
    second.join(30.0)
    try:
        assert outcome[0] == f"placed on {worker}"
        assert outcome[1].startswith("refused: no live worker has the memory"), outcome[1]
    finally:
        with quiet_engine.begin() as cleanup:
            cleanup.execute(sa.text("DELETE FROM workers WHERE id = :id"), {"id": worker})
