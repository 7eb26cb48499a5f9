"""Adapters paged out to disk past `max_loaded_adapters` come back bit for bit: training many
adapters interleaved under a limit ends in exactly the state of the same run with no limit;
snapshots of a paged-out adapter keep sampling; dropping one deletes its file; the worker's
configuration carries the limit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_support import ADAM, DATA, PROMPT, TINY, logprobs, new_adapter, randomise_b

from treadle.engine import Engine, LoraSpec, SamplingSpec
from treadle.engine.memory.paging import SPILL_SUFFIX
from treadle.platform.config import DEFAULT_MAX_LOADED_ADAPTERS, PlatformConfig

# Different ranks and targets, so a restored tensor in the wrong place could not fit.
SPECS = [
    LoraSpec(rank=4, alpha=8.0, seed=1),
    LoraSpec(rank=2, alpha=4.0, seed=2, train_unembed=False),
    LoraSpec(rank=8, alpha=8.0, seed=3, train_attn=False),
]


def interleaved_run(engine: Engine) -> list[str]:
    """Three adapters trained round robin: every forward_backward of one between another's
    forward_backward and optim_step, so grads are pending while it is paged out; ends with
    grads pending on all three."""
    ids = [new_adapter(engine, spec) for spec in SPECS]
    for i, adapter in enumerate(ids):
        randomise_b(engine, adapter, seed=i)  # nonzero B, so A's grads are nonzero too
    for step in range(3):
        for adapter in ids:
            engine.forward_backward(adapter, DATA[step:], "cross_entropy")
        for adapter in ids:
            engine.optim_step(adapter, ADAM)
    for adapter in ids:
        engine.forward_backward(adapter, DATA[:2], "cross_entropy")
    return ids


def assert_same_state(engine: Engine, ids: list[str], other: Engine, other_ids: list[str]) -> None:
    for ours, theirs in zip(ids, other_ids, strict=True):
        assert engine.state_hashes(ours) == other.state_hashes(theirs)
        for part in (Engine.adapter_weights, Engine.adapter_grads):
            expected = part(other, theirs)
            for name, array in part(engine, ours).items():
                np.testing.assert_array_equal(array, expected[name], err_msg=name)


@pytest.mark.parametrize("limit", [1, 2])
def test_interleaved_training_under_a_limit_equals_training_without_one(
    cache_dir: Path, tmp_path: Path, limit: int
) -> None:
    paged = Engine(cache_dir=cache_dir, device="cpu", max_loaded_adapters=limit,
                   spill_dir=tmp_path)  # fmt: skip
    ids = interleaved_run(paged)
    assert len(paged.loaded_adapters()) == limit
    assert sorted(paged.spilled_adapters()) == sorted(set(ids) - set(paged.loaded_adapters()))
    assert all(path.is_file() for path in paged.spilled_adapters().values())
    unlimited = Engine(cache_dir=cache_dir, device="cpu")
    reference = interleaved_run(unlimited)
    assert_same_state(paged, ids, unlimited, reference)
    # ... and they keep training alike after coming back.
    for engine, adapters in ((paged, ids), (unlimited, reference)):
        for adapter in adapters:
            engine.optim_step(adapter, ADAM)
    assert_same_state(paged, ids, unlimited, reference)


def test_limit_keeps_the_most_recently_used_in_memory(cache_dir: Path, tmp_path: Path) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_loaded_adapters=2, spill_dir=tmp_path)
    ids = [new_adapter(engine) for _ in range(4)]
    assert engine.loaded_adapters() == ids[2:]
    assert sorted(engine.spilled_adapters()) == sorted(ids[:2])
    logprobs(engine, ids[0], DATA[:1])
    assert engine.loaded_adapters() == [ids[3], ids[0]]
    assert sorted(engine.spilled_adapters()) == sorted(ids[1:3])
    assert len(list(tmp_path.iterdir())) == 2  # one file per paged-out adapter, nothing else
    assert all(engine.has_adapter(a) for a in ids)


def test_reading_a_paged_out_adapter_brings_it_to_host_memory_only(
    cache_dir: Path, tmp_path: Path
) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_resident_adapters=1,
                    max_loaded_adapters=2, spill_dir=tmp_path)  # fmt: skip
    first, second, third = (new_adapter(engine) for _ in range(3))
    assert engine.resident_adapters() == [third]
    assert engine.loaded_adapters() == [second, third]
    engine.adapter_weights(first)  # a read: back in memory, not onto the accelerator
    assert engine.loaded_adapters() == [third, first]
    assert engine.resident_adapters() == [third]
    logprobs(engine, first, DATA[:1])
    assert engine.resident_adapters() == [first]
    assert list(engine.spilled_adapters()) == [second]


def test_paged_out_adapters_snapshot_samples_the_same_tokens(
    cache_dir: Path, tmp_path: Path
) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_loaded_adapters=1, spill_dir=tmp_path)
    adapter = new_adapter(engine)
    randomise_b(engine, adapter, seed=7, std=0.5)
    engine.snapshot(adapter, "paged-snap")
    params = SamplingSpec(max_tokens=8, temperature=1.0, seed=5, stop=())
    before = engine.sample(TINY, "paged-snap", PROMPT, 2, params).sequences
    new_adapter(engine)
    assert adapter in engine.spilled_adapters()
    after = engine.sample(TINY, "paged-snap", PROMPT, 2, params).sequences
    assert [s.tokens for s in after] == [s.tokens for s in before]
    assert [s.logprobs for s in after] == [s.logprobs for s in before]
    base = engine.sample(TINY, None, PROMPT, 2, params).sequences
    assert [s.tokens for s in base] != [s.tokens for s in before]  # the snapshot matters


def test_dropping_a_paged_out_adapter_deletes_its_file(cache_dir: Path, tmp_path: Path) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_loaded_adapters=1, spill_dir=tmp_path)
    adapter = new_adapter(engine)
    engine.snapshot(adapter, "kept-after-drop")
    new_adapter(engine)
    path = engine.spilled_adapters()[adapter]
    assert path.is_file()
    engine.drop_adapter(adapter, keep_snapshots=True)
    assert not path.exists()
    assert adapter not in engine.spilled_adapters()
    assert not engine.has_adapter(adapter)
    engine.sample(TINY, "kept-after-drop", PROMPT, 1, SamplingSpec(max_tokens=2, seed=0))


def test_stale_spill_files_are_deleted_at_start(cache_dir: Path, tmp_path: Path) -> None:
    stale, other = tmp_path / f"7{SPILL_SUFFIX}", tmp_path / "notes.txt"
    stale.write_bytes(b"from a process that died")
    (tmp_path / f"8{SPILL_SUFFIX}.partial").write_bytes(b"half written")
    other.write_text("not ours")
    Engine(cache_dir=cache_dir, device="cpu", max_loaded_adapters=1, spill_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_adapter_stays_in_memory_when_its_file_cannot_be_written(
    cache_dir: Path, tmp_path: Path
) -> None:
    spill_dir = tmp_path / "spill"
    engine = Engine(cache_dir=cache_dir, device="cpu", max_loaded_adapters=1, spill_dir=spill_dir)
    first = new_adapter(engine)
    spill_dir.rmdir()
    spill_dir.write_text("a file where the folder was")  # every write under it now fails
    second = new_adapter(engine)
    assert engine.loaded_adapters() == [first, second]  # over the limit, nothing lost
    assert engine.spilled_adapters() == {}
    logprobs(engine, first, DATA[:1])
    spill_dir.unlink()
    spill_dir.mkdir()
    logprobs(engine, first, DATA[:1])  # the disk is back: the limit holds again
    assert engine.loaded_adapters() == [first]
    assert list(engine.spilled_adapters()) == [second]


def test_limit_below_one_is_refused(cache_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_loaded_adapters is 0"):
        Engine(cache_dir=cache_dir, device="cpu", max_loaded_adapters=0)


def test_worker_config_reads_the_limit_and_passes_it_to_children() -> None:
    assert PlatformConfig.from_env({}).max_loaded_adapters == DEFAULT_MAX_LOADED_ADAPTERS
    config = PlatformConfig.from_env({"TREADLE_MAX_LOADED_ADAPTERS": "2"})
    assert config.max_loaded_adapters == 2
    assert PlatformConfig.from_env(config.to_env()).max_loaded_adapters == 2
    assert PlatformConfig.from_env({"TREADLE_MAX_LOADED_ADAPTERS": "0"}).max_loaded_adapters == 0
    with pytest.raises(ValueError, match="TREADLE_MAX_LOADED_ADAPTERS must be a whole number"):
        PlatformConfig.from_env({"TREADLE_MAX_LOADED_ADAPTERS": "1.5"})
    assert config.spill_dir("w0") == config.data_dir / "spill" / "w0"
