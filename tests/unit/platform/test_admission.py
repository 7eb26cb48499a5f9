"""Admission's arithmetic (treadle/platform/sessions/admission.py), by hand on made-up footprints:
what an adapter costs for its rank and targets, which adapters count as resident, the working
set, what a worker that reports nothing new is judged by, and the refusal's numbers. The worker's
side (footprints from real modules) is tests/unit/engine/test_footprint.py; a real platform
refusing and admitting, tests/compat/test_model_admission.py."""

from __future__ import annotations

from typing import Any

from treadle.platform.sessions.admission import (
    BYTES_PER_LORA_PARAMETER,
    GRADIENT_BUFFERS,
    Held,
    budget,
    lora_parameters,
    need_words,
    room,
)

MiB = 2**20
FOOTPRINT = {
    "weight_bytes": 10 * MiB,
    "lora_per_rank": {"attn": 1000, "mlp": 3000, "unembed": 50_000},
    "pass_bytes": 4 * MiB,
    "kv_bytes": 2 * MiB,
}
SMALL = {**FOOTPRINT, "weight_bytes": 1 * MiB, "pass_bytes": 1 * MiB, "kv_bytes": 1 * MiB}


def _info(capacity: int, resident: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "models": ["m", "s"],
        "refused": {},
        "budget": {"capacity_bytes": capacity, "resident_adapters": resident},
        "footprints": {"m": FOOTPRINT, "s": SMALL},
        **extra,
    }


def _lora(rank: int, **flags: bool) -> dict[str, Any]:
    return {"rank": rank, "alpha": 32.0, **flags}


def _session(n: int, rank: int, base: str = "m", **flags: bool) -> Held:
    return Held(f"s{n}", base, "training", _lora(rank, **flags))


def test_lora_parameters_are_rank_times_the_trained_categories_in_plus_out() -> None:
    assert lora_parameters(FOOTPRINT, _lora(8)) == 8 * 54_000
    assert lora_parameters(FOOTPRINT, _lora(8, train_unembed=False)) == 8 * 4000
    assert lora_parameters(FOOTPRINT, _lora(2, train_attn=False, train_unembed=False)) == 6000


def test_budget_adds_base_sessions_and_the_working_set() -> None:
    held = [_session(1, 4), _session(2, 8, train_unembed=False)]
    b = budget("w", _info(100 * MiB), held)
    assert b is not None and b.complete
    adapters = [4 * 54_000, 8 * 4000]
    assert b.base_bytes == 10 * MiB and b.base_models == ("m",)
    assert b.session_bytes == BYTES_PER_LORA_PARAMETER * sum(adapters)
    # one pass and the KV budget of the model, plus the largest adapter's gradient buffers
    assert b.working_bytes == 6 * MiB + GRADIENT_BUFFERS * 4 * max(adapters)
    assert b.free_bytes == 100 * MiB - b.base_bytes - b.session_bytes - b.working_bytes


def test_on_a_bfloat16_model_an_adapter_also_holds_the_copy_its_passes_run_in() -> None:
    """A footprint's `adapter_copy_bytes` (2 on a bfloat16 model: the adapter's passes run a
    bfloat16 copy of its float32 masters) adds to each adapter's 16 bytes a parameter; the
    gradient buffers stay float32."""
    bf16 = {**FOOTPRINT, "adapter_copy_bytes": 2}
    info = {**_info(100 * MiB), "footprints": {"m": bf16, "s": SMALL}}
    held = [_session(1, 4), _session(2, 8, train_unembed=False)]
    b = budget("w", info, held)
    assert b is not None
    adapters = [4 * 54_000, 8 * 4000]
    assert b.session_bytes == (BYTES_PER_LORA_PARAMETER + 2) * sum(adapters)
    assert b.working_bytes == 6 * MiB + GRADIENT_BUFFERS * 4 * max(adapters)
    words = need_words(info, _session(3, 8))
    assert "(432,000 LoRA parameters x 18 bytes = 7.42 MiB" in words
    assert "and the copy its passes run in" in words
    assert "x 16 bytes" in need_words(_info(100 * MiB), _session(3, 8))


def test_only_the_largest_resident_adapters_count_where_the_rest_page_out() -> None:
    held = [_session(1, 1), _session(2, 16), _session(3, 4)]
    b = budget("w", _info(100 * MiB, resident=2), held)
    assert b is not None
    assert (b.sessions, b.resident) == (3, 2)
    assert b.session_bytes == BYTES_PER_LORA_PARAMETER * 54_000 * (16 + 4)


def test_a_base_model_counts_once_and_a_loaded_one_without_sessions_counts_too() -> None:
    held = [_session(1, 4), _session(2, 4)]
    b = budget("w", _info(100 * MiB, loaded_models=["s"]), held)
    assert b is not None
    assert b.base_models == ("m", "s") and b.base_bytes == 11 * MiB
    assert b.working_bytes == 6 * MiB + GRADIENT_BUFFERS * 4 * 4 * 54_000  # the larger model's


def test_a_sampling_session_holds_no_adapter() -> None:
    b = budget("w", _info(100 * MiB), [Held("x", "s", "sampling", {})])
    assert b is not None and (b.sessions, b.session_bytes) == (0, 0)
    assert b.base_bytes == 1 * MiB and b.working_bytes == 2 * MiB


def test_a_worker_reporting_no_budget_is_not_judged() -> None:
    info = {"models": ["m"], "refused": {}, "model_memory_bytes": 1}
    assert budget("w", info, [_session(1, 128)]) is None
    assert room("w", info, [_session(1, 128)], _session(2, 128)) == (None, None)


def test_a_model_without_a_footprint_yet_is_not_judged() -> None:
    why, _ = room("w", _info(1), [], _session(1, 4, base="new"))
    assert why is None


def test_room_refuses_with_the_numbers_and_admits_what_fits() -> None:
    info = _info(30 * MiB)
    held = [_session(1, 8)]  # 10 MiB base, a 6.6 MiB adapter, a 10.9 MiB working set
    fits = _session(2, 1, train_unembed=False)
    assert room("w", info, held, fits)[0] is None
    why, now = room("w", info, held, _session(3, 8))
    assert why is not None and now is not None
    assert why.startswith("w has 30.00 MiB per device: 10.00 MiB held by base models (m), ")
    assert "6.59 MiB by 1 resident adapters of 1 sessions" in why
    assert "with this session it would need" in why
    words = need_words(info, _session(3, 8))
    assert "rank-8 LoRA session on m training attn, mlp, unembed" in words
    assert f"{8 * 54_000:,} LoRA parameters x 16 bytes = 6.59 MiB" in words


def test_a_resent_create_does_not_count_its_session_twice() -> None:
    info = _info(30 * MiB)
    held = [_session(1, 8)]
    assert room("w", info, held, _session(1, 8))[0] is None
