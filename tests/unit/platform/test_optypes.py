"""The operation vocabulary: one payload class per type, and what each says about replay."""

from __future__ import annotations

import pytest

from treadle.platform.eventlog import optypes
from treadle.platform.eventlog.optypes import OpType

LORA = optypes.LoraConfig(rank=4, alpha=8.0)
FB = {
    "loss_fn": "cross_entropy",
    "loss_fn_config": {},
    "data": [
        {
            "tokens": [1, 2, 3],
            "loss_fn_inputs": {"weights": {"dtype": "float32", "shape": [3], "data": [1, 1, 0.5]}},
        }
    ],
}
EXAMPLES = {
    OpType.CREATE_MODEL: optypes.CreateModel(base_model="m", lora_config=LORA),
    OpType.LOAD_WEIGHTS: optypes.LoadWeights(
        path="tinker://x/weights/a", prefix="p", optimizer=True, base_model="m", lora_config=LORA
    ),
    OpType.FORWARD_BACKWARD: optypes.ForwardBackward(**FB, forward_only=False),
    OpType.OPTIM_STEP: optypes.OptimStep(learning_rate=1e-3),
    OpType.SAVE_WEIGHTS: optypes.SaveWeights(
        path="tinker://x/weights/a",
        prefix="p",
        ttl_seconds=None,
        with_optimizer=True,
        merge_weights=False,
    ),  # fmt: skip
    OpType.SAVE_WEIGHTS_FOR_SAMPLER: optypes.SaveWeightsForSampler(sampler_id="s"),
    OpType.SAMPLE: optypes.Sample(
        prompt=[1, 2],
        snapshot_id=None,
        checkpoint_prefix=None,
        num_samples=1,
        prompt_logprobs=False,
        params=optypes.SamplingParams(max_tokens=4),
    ),  # fmt: skip
    OpType.LOAD_SAMPLER_WEIGHTS: optypes.LoadSamplerWeights(
        snapshot_id="checkpoint:tinker://sess-1:train:0/weights/state-000003",
        checkpoint_prefix="tenants/t/sessions/sess-1:train:0/weights/state-000003",
    ),
    OpType.REBUILD: optypes.Rebuild(
        source_session_id="sess-1:train:0",
        to_seq=7,
        mode=optypes.RebuildMode.FORK,
        base_model="m",
        lora_config=LORA,
    ),  # fmt: skip
}


def test_every_type_has_one_payload_class() -> None:
    assert set(optypes.PAYLOADS) == set(OpType)
    assert all(op_type == cls.TYPE for op_type, cls in optypes.PAYLOADS.items())


@pytest.mark.parametrize("op_type", list(OpType))
def test_payload_round_trips_through_the_log(op_type: OpType) -> None:
    payload = EXAMPLES[op_type]
    assert optypes.parse_payload(op_type.value, payload.to_json()) == payload


def test_state_changing_operations_record_what_they_change() -> None:
    changing = {t for t, p in EXAMPLES.items() if p.changes_state}
    assert changing == {
        OpType.CREATE_MODEL,
        OpType.LOAD_WEIGHTS,
        OpType.FORWARD_BACKWARD,
        OpType.OPTIM_STEP,
        OpType.REBUILD,  # a replay's or fork's whole state, rebuilt from its source's log
    }
    assert all(EXAMPLES[t].state_parts for t in changing)
    assert EXAMPLES[OpType.FORWARD_BACKWARD].state_parts == ("grads",)


def test_forward_only_is_neither_state_changing_nor_replayed() -> None:
    forward = optypes.ForwardBackward(**FB, forward_only=True)
    assert not forward.changes_state and not forward.is_replayed and forward.state_parts == ()


def test_sampler_snapshots_are_replayed_but_change_no_state() -> None:
    snapshot = EXAMPLES[OpType.SAVE_WEIGHTS_FOR_SAMPLER]
    assert snapshot.is_replayed and not snapshot.changes_state
    assert not EXAMPLES[OpType.SAVE_WEIGHTS].is_replayed


def test_only_a_samplers_operations_run_outside_the_seq_order() -> None:
    unordered = [t for t, p in EXAMPLES.items() if not p.is_ordered]
    assert unordered == [OpType.SAMPLE, OpType.LOAD_SAMPLER_WEIGHTS]


def test_a_damaged_payload_names_its_type() -> None:
    with pytest.raises(ValueError, match="optim_step"):
        optypes.parse_payload("optim_step", {"learning_rate": "fast"})
    bad = {**FB, "forward_only": False}
    bad["data"][0]["loss_fn_inputs"]["weights"]["shape"] = [4]
    with pytest.raises(ValueError, match="forward_backward"):
        optypes.parse_payload("forward_backward", bad)


def test_an_adamw_session_logs_what_it_logged_before_dimuon() -> None:
    """No `optimizer` key where it is AdamW: old logs and new ones read (and hash) the same."""
    lora = optypes.LoraConfig(rank=4, alpha=8.0)
    assert (
        "optimizer"
        not in optypes.CreateModel(base_model="m", lora_config=lora).to_json()["lora_config"]
    )
    step = optypes.OptimStep(learning_rate=0.1)
    assert "optimizer" not in step.to_json()
    assert optypes.parse_payload("optim_step", step.to_json()) == step


def test_a_dimuon_step_logs_its_own_fields_and_round_trips() -> None:
    step = optypes.OptimStep(optimizer="dimuon", learning_rate=0.1, beta1=0.8)
    data = step.to_json()
    assert data == {
        "optimizer": "dimuon",
        "learning_rate": 0.1,
        "beta1": 0.8,
        "grad_clip_norm": 0.0,
    }
    assert optypes.parse_payload("optim_step", data) == step
    lora = optypes.LoraConfig(rank=4, alpha=8.0, optimizer="dimuon")
    created = optypes.CreateModel(base_model="m", lora_config=lora).to_json()
    assert optypes.parse_payload("create_model", created).lora_config.optimizer == "dimuon"


def test_a_dimuon_step_with_adam_settings_is_refused() -> None:
    with pytest.raises(ValueError, match="beta2, weight_decay are AdamW settings"):
        optypes.OptimStep(optimizer="dimuon", beta2=0.5, weight_decay=0.1)
