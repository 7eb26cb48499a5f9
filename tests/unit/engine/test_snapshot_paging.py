"""Sampling snapshots past `max_loaded_snapshots` page out to disk and come back bit for bit:
a paged-out snapshot samples exactly the tokens and logprobs it sampled before; the most recently
used stay in memory; dropping one (or its adapter) deletes its file; an unreadable file is a clear
retryable error for that request alone; an RL-style loop (a snapshot a step) keeps the limit."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support import PROMPT, TINY, new_adapter, randomise_b

from treadle.engine import Engine, SampleRequest, SamplingSpec
from treadle.engine.lora.snapshots import SNAPSHOT_SUFFIX
from treadle.platform.config import DEFAULT_MAX_LOADED_SNAPSHOTS, PlatformConfig
from treadle.platform.errors import UnavailableError

PARAMS = SamplingSpec(max_tokens=6, temperature=1.0, seed=11, stop=())


def drawn(engine: Engine, snapshot_id: str) -> tuple[list[list[int]], list[list[float]]]:
    sequences = engine.sample(TINY, snapshot_id, PROMPT, 2, PARAMS).sequences
    return [s.tokens for s in sequences], [s.logprobs for s in sequences]


def snapshots_of_distinct_weights(engine: Engine, count: int) -> list[str]:
    """`count` snapshots of one adapter, its B changed before each, so no two sample alike."""
    adapter = new_adapter(engine)
    ids = []
    for i in range(count):
        randomise_b(engine, adapter, seed=100 + i, std=0.5)
        engine.snapshot(adapter, f"snap-{i}")
        ids.append(f"snap-{i}")
    return ids


def test_a_paged_out_snapshot_samples_what_it_sampled_before(
    cache_dir: Path, tmp_path: Path
) -> None:
    unlimited = Engine(cache_dir=cache_dir, device="cpu")
    paged = Engine(cache_dir=cache_dir, device="cpu", max_loaded_snapshots=1, spill_dir=tmp_path)
    ids = snapshots_of_distinct_weights(unlimited, 3)
    assert snapshots_of_distinct_weights(paged, 3) == ids
    assert sorted(paged.spilled_snapshots()) == ids[:2]
    assert all(path.is_file() for path in paged.spilled_snapshots().values())
    expected = [drawn(unlimited, s) for s in ids]
    assert len({str(e) for e in expected}) == 3  # the weights differ, and it shows
    assert [drawn(paged, s) for s in ids] == expected  # each read back bit for bit
    assert paged.snapshot_counts() == (1, 2)


def test_the_most_recently_used_stay_in_memory(cache_dir: Path, tmp_path: Path) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_loaded_snapshots=2, spill_dir=tmp_path)
    ids = snapshots_of_distinct_weights(engine, 4)
    assert sorted(engine.spilled_snapshots()) == ids[:2]
    drawn(engine, ids[0])  # read back; the least recently used of the others goes out
    assert sorted(engine.spilled_snapshots()) == [ids[1], ids[2]]
    assert len(list(tmp_path.glob(f"*{SNAPSHOT_SUFFIX}"))) == 2  # one file each, nothing else


def test_dropping_snapshots_deletes_their_files(cache_dir: Path, tmp_path: Path) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_loaded_snapshots=1, spill_dir=tmp_path)
    adapter = new_adapter(engine)
    for name in ("a", "b", "c"):
        engine.snapshot(adapter, name)
    files = engine.spilled_snapshots()
    assert sorted(files) == ["a", "b"]
    engine.drop_snapshot("a")
    assert not files["a"].exists() and not engine.has_snapshot("a")
    engine.drop_adapter(adapter)  # and the snapshots taken from it
    assert not files["b"].exists()
    assert engine.snapshot_counts() == (0, 0)
    assert list(tmp_path.iterdir()) == []


def test_a_paged_out_snapshot_outlives_its_adapter_when_kept(
    cache_dir: Path, tmp_path: Path
) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_loaded_snapshots=1, spill_dir=tmp_path)
    ids = snapshots_of_distinct_weights(engine, 2)
    before = drawn(engine, ids[0])
    engine.snapshot(new_adapter(engine), "other")  # pages ids[0] out
    assert ids[0] in engine.spilled_snapshots()
    for adapter in engine.loaded_adapters():
        engine.drop_adapter(adapter, keep_snapshots=True)
    assert drawn(engine, ids[0]) == before


def test_an_unreadable_file_fails_that_request_alone_and_is_forgotten(
    cache_dir: Path, tmp_path: Path
) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_loaded_snapshots=1, spill_dir=tmp_path)
    ids = snapshots_of_distinct_weights(engine, 2)
    engine.spilled_snapshots()[ids[0]].write_bytes(b"damaged")
    requests = [SampleRequest(TINY, s, PROMPT, 1, PARAMS) for s in ids]
    broken, fine = engine.sample_batch(requests)
    assert isinstance(broken, UnavailableError)
    assert "cannot be read back" in str(broken) and "retry" in str(broken)
    assert not isinstance(fine, Exception) and len(fine.sequences[0].tokens) == 6
    assert not engine.has_snapshot(ids[0])  # the host rebuilds it from the log next time
    assert list(tmp_path.glob(f"*{SNAPSHOT_SUFFIX}")) == []


def test_a_snapshot_a_step_keeps_memory_at_the_limit(cache_dir: Path, tmp_path: Path) -> None:
    engine = Engine(cache_dir=cache_dir, device="cpu", max_loaded_snapshots=3, spill_dir=tmp_path)
    adapter = new_adapter(engine)
    for step in range(10):
        engine.snapshot(adapter, f"step-{step}")
        drawn(engine, f"step-{step}")
        assert engine.snapshot_counts()[0] <= 3
    assert engine.snapshot_counts() == (3, 7)


def test_stale_snapshot_files_are_deleted_at_start(cache_dir: Path, tmp_path: Path) -> None:
    (tmp_path / f"3{SNAPSHOT_SUFFIX}").write_bytes(b"from a process that died")
    (tmp_path / f"4{SNAPSHOT_SUFFIX}.partial").write_bytes(b"half written")
    (tmp_path / "notes.txt").write_text("not ours")
    Engine(cache_dir=cache_dir, device="cpu", max_loaded_snapshots=1, spill_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_limit_below_one_is_refused(cache_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_loaded_snapshots is 0"):
        Engine(cache_dir=cache_dir, device="cpu", max_loaded_snapshots=0)


def test_worker_config_reads_the_limit_and_passes_it_to_children() -> None:
    assert PlatformConfig.from_env({}).max_loaded_snapshots == DEFAULT_MAX_LOADED_SNAPSHOTS
    config = PlatformConfig.from_env({"TREADLE_MAX_LOADED_SNAPSHOTS": "3"})
    assert PlatformConfig.from_env(config.to_env()).max_loaded_snapshots == 3
    assert PlatformConfig.from_env({"TREADLE_MAX_LOADED_SNAPSHOTS": "0"}).max_loaded_snapshots == 0
    with pytest.raises(ValueError, match="TREADLE_MAX_LOADED_SNAPSHOTS must be a whole number"):
        PlatformConfig.from_env({"TREADLE_MAX_LOADED_SNAPSHOTS": "2.5"})
