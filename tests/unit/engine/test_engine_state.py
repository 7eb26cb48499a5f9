"""What recovery relies on from the engine: state fingerprints that change exactly with the
state, exact restores from an exported adapter, snapshots that outlive a rebuilt adapter, and
interrupts that stop long calls at a step boundary."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support import ADAM, DATA, TINY, new_adapter, train

from treadle.engine import Engine, SamplingSpec


class Stop(Exception):
    pass


def test_forward_backward_changes_only_the_grads(engine: Engine) -> None:
    adapter = new_adapter(engine)
    before = engine.state_hashes(adapter)
    engine.forward_backward(adapter, DATA, "cross_entropy")
    after = engine.state_hashes(adapter)
    assert after["grads"] != before["grads"]
    assert (after["weights"], after["optimizer"]) == (before["weights"], before["optimizer"])


def test_optim_step_changes_weights_and_optimizer_and_clears_grads(engine: Engine) -> None:
    adapter = new_adapter(engine)
    fresh = engine.state_hashes(adapter)
    engine.forward_backward(adapter, DATA, "cross_entropy")
    engine.optim_step(adapter, ADAM)
    stepped = engine.state_hashes(adapter)
    assert stepped["weights"] != fresh["weights"]
    assert stepped["optimizer"] != fresh["optimizer"]
    assert stepped["grads"] == fresh["grads"]  # none pending, as before any forward_backward


def test_same_operations_give_same_fingerprints(engine: Engine) -> None:
    first, second = new_adapter(engine), new_adapter(engine)
    for adapter in (first, second):
        train(engine, adapter, 2)
    assert engine.state_hashes(first) == engine.state_hashes(second)
    engine.forward_backward(first, DATA[:1], "cross_entropy")
    assert engine.state_hashes(first)["grads"] != engine.state_hashes(second)["grads"]


def test_export_and_import_restore_every_fingerprint(engine: Engine, tmp_path: Path) -> None:
    adapter = new_adapter(engine)
    train(engine, adapter, 2)
    engine.export_adapter(adapter, tmp_path, with_optimizer=True)
    engine.import_adapter("restored", TINY, tmp_path, with_optimizer=True)
    assert engine.state_hashes("restored") == engine.state_hashes(adapter)
    train(engine, adapter, 1)
    train(engine, "restored", 1)
    assert engine.state_hashes("restored") == engine.state_hashes(adapter)


def test_dropping_an_adapter_can_keep_its_snapshots(engine: Engine) -> None:
    adapter = new_adapter(engine)
    engine.snapshot(adapter, "kept-snap")
    engine.drop_adapter(adapter, keep_snapshots=True)
    assert engine.has_snapshot("kept-snap")
    engine.sample(TINY, "kept-snap", [1, 2], 1, SamplingSpec(max_tokens=2, seed=0))


def test_interrupt_stops_sampling_between_decoding_steps(engine: Engine) -> None:
    steps = 0

    def interrupt() -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            raise Stop

    with pytest.raises(Stop):
        engine.sample(TINY, None, [1, 2], 2, SamplingSpec(max_tokens=50, stop=()),
                      interrupt=interrupt)  # fmt: skip
    assert steps == 3


def test_interrupt_stops_forward_backward_between_microbatches(engine: Engine) -> None:
    adapter = new_adapter(engine)

    def interrupt() -> None:
        raise Stop

    with pytest.raises(Stop):
        engine.forward_backward(adapter, DATA, "cross_entropy", interrupt=interrupt)
