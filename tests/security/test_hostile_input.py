"""Hostile input is refused at the edge, before anything is allocated or appended: each case of
issue 8's fuzzing report (deep nesting, NaN in user_metadata, huge sparse and dense shapes, huge
seeds and temperatures, a tiny top_p, 10 MB bodies, absurd integers) is a 4xx naming the field
and the rule, never a 500, and the event log is unchanged."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from tinker.proto import tinker_public_pb2 as pb

from tests.secure_app import SecureApp
from treadle.platform.models import validation

pytestmark = pytest.mark.integration

PROTO = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}


@pytest.fixture(scope="module")
def session_id(secure: SecureApp) -> str:
    answer = secure.call("POST", "/api/v1/create_session", secure.operator_key, json={})
    assert answer.status_code == 200, answer.get_data(as_text=True)
    return str(answer.get_json()["session_id"])


@pytest.fixture(scope="module")
def model_id(secure: SecureApp, session_id: str) -> str:
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": "treadle/tiny-debug"}
    answer = secure.call("POST", "/api/v1/create_model", secure.operator_key, json=body)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    return str(answer.get_json()["model_id"])


@pytest.fixture(scope="module")
def sampler_id(secure: SecureApp, session_id: str) -> str:
    body = {
        "session_id": session_id,
        "sampling_session_seq_id": 0,
        "base_model": "treadle/tiny-debug",
    }
    answer = secure.call("POST", "/api/v1/create_sampling_session", secure.operator_key, json=body)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    return str(answer.get_json()["sampling_session_id"])


def refused(secure: SecureApp, path: str, status: int = 400, **request: Any) -> str:
    """POST `request` to `path`: it must answer `status` and append nothing; its message."""
    secure.keep_worker_alive()
    before = secure.event_count()
    answer = secure.call("POST", path, secure.operator_key, **request)
    assert answer.status_code == status, answer.get_data(as_text=True)
    assert secure.event_count() == before
    return str(answer.get_json()["error"]["message"])


def raw_json(text: str) -> dict[str, Any]:
    """A JSON body sent byte for byte (the test client's json= would re-encode it)."""
    return {"data": text.encode(), "headers": JSON}


def sample(sampler_id: str, **params: Any) -> dict[str, Any]:
    body = {"sampling_session_id": sampler_id, "prompt": PROMPT, "sampling_params": params}
    return {"json": body}


def fwdbwd(model_id: str, *tensors: tuple[str, pb.Tensor], tokens: int = 3, seq: int = 1) -> Any:
    """A forward_backward body of one datum of `tokens` tokens with the given loss inputs."""
    datum = pb.Datum()
    datum.model_input.add().encoded_text.tokens = np.arange(1, tokens + 1, dtype="<i4").tobytes()
    for name, tensor in tensors:
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy")
    msg.data.append(datum)
    return {"data": msg.SerializeToString(), "headers": PROTO}


def sparse(shape: list[int], crow: list[int], col: list[int], values: list[float]) -> pb.Tensor:
    return pb.Tensor(
        dtype=pb.DTYPE_FLOAT32,
        shape=shape,
        sparse_csr=pb.SparseCsr(
            values=np.asarray(values, dtype="<f4").tobytes(),
            crow_indices=np.asarray(crow, dtype="<i8").tobytes(),
            col_indices=np.asarray(col, dtype="<i8").tobytes(),
        ),
    )


def dense(shape: list[int], values: list[float]) -> pb.Tensor:
    data = np.asarray(values, dtype="<f4").tobytes()
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, dense=data)


# -- JSON: nesting, literals, numbers -------------------------------------------------------


def _url(rule: Any) -> str:
    return rule.rule.replace("<path:", "<").replace("<", "").replace(">", "-missing")


def test_deep_nesting_is_refused_on_every_json_route(secure: SecureApp) -> None:
    """Every POST/PUT route either refuses the nesting (400 naming the rule) or never reads its
    body (the same answer as for {}); none recurses into it."""
    deep = "[" * 100_000 + "]" * 100_000
    refused_by = []
    for rule in secure.app.url_map.iter_rules():
        if rule.endpoint == "training.forward_backward":
            continue  # protobuf
        if rule.endpoint.startswith("sagemaker."):
            continue  # signed requests: test_sagemaker_surface.py sends them this body
        for method in sorted((rule.methods or set()) & {"POST", "PUT", "PATCH"}):
            before = secure.event_count()
            answer = secure.call(method, _url(rule), secure.operator_key, **raw_json(deep))
            assert answer.status_code < 500, (rule.rule, answer.get_data(as_text=True))
            assert secure.event_count() == before, rule.rule
            message = (answer.get_json().get("error") or {}).get("message", "")
            if answer.status_code == 400 and "more than 64 levels deep" in message:
                refused_by.append(rule.rule)
                continue
            plain = secure.call(method, _url(rule), secure.operator_key, **raw_json("{}"))
            assert (answer.status_code, answer.get_json()) == (plain.status_code, plain.get_json())
    assert "/api/v1/create_session" in refused_by and "/api/v1/asample" in refused_by
    assert len(refused_by) >= 15


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_literal_in_user_metadata_is_refused(secure: SecureApp, literal: str) -> None:
    body = '{"tags": [], "user_metadata": {"run": {"score": ' + literal + "}}}"
    message = refused(secure, "/api/v1/create_session", **raw_json(body))
    assert f"user_metadata.run.score is {literal}" in message


def test_nan_in_adam_params_is_refused(secure: SecureApp, model_id: str) -> None:
    body = json.dumps({"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.5}})
    body = body.replace("0.5", "NaN")
    message = refused(secure, "/api/v1/optim_step", **raw_json(body))
    assert "adam_params.learning_rate is NaN" in message


def test_infinite_temperature_literal_is_refused(secure: SecureApp, sampler_id: str) -> None:
    text = json.dumps(sample(sampler_id)["json"]).replace(
        '"sampling_params": {}', '"sampling_params": {"temperature": Infinity}'
    )
    message = refused(secure, "/api/v1/asample", **raw_json(text))
    assert "sampling_params.temperature is Infinity" in message


def test_overflowing_float_is_refused(secure: SecureApp) -> None:
    message = refused(
        secure, "/api/v1/create_session", **raw_json('{"user_metadata": {"x": 1e400}}')
    )
    assert "user_metadata.x is 1e400, which overflows" in message


def test_integer_of_thousands_of_digits_is_refused_before_parsing(
    secure: SecureApp, model_id: str
) -> None:
    body = json.dumps({"model_id": model_id, "seq_id": 1}).replace(": 1}", ": " + "9" * 5000 + "}")
    message = refused(secure, "/api/v1/optim_step", **raw_json(body))
    assert "seq_id is an integer of 5000 digits" in message


def test_out_of_range_id_is_refused(secure: SecureApp, session_id: str) -> None:
    body = {"session_id": session_id, "model_seq_id": 10**19, "base_model": "treadle/tiny-debug"}
    message = refused(secure, "/api/v1/create_model", json=body)
    assert "model_seq_id" in message and "less than or equal to" in message


def test_unpaired_surrogate_is_refused(secure: SecureApp) -> None:
    message = refused(secure, "/api/v1/create_session", **raw_json('{"tags": ["\\ud800"]}'))
    assert "tags[0] is a string with an unpaired UTF-16 surrogate" in message


def test_body_that_is_not_utf8_is_refused(secure: SecureApp) -> None:
    message = refused(secure, "/api/v1/create_session", data=b'{"tags": ["\xff"]}', headers=JSON)
    assert "not UTF-8" in message


# -- user_metadata and tags -------------------------------------------------------------------


def test_oversized_user_metadata_is_refused(secure: SecureApp) -> None:
    body = {"user_metadata": {"blob": "x" * (validation.MAX_METADATA_BYTES + 1)}}
    message = refused(secure, "/api/v1/create_session", json=body)
    assert f"at most {validation.MAX_METADATA_BYTES} are allowed" in message


def test_deeply_nested_user_metadata_is_refused(secure: SecureApp) -> None:
    body = {"user_metadata": {"a": {"b": {"c": {"d": {"e": 1}}}}}}
    message = refused(secure, "/api/v1/create_session", json=body)
    assert "user_metadata.a.b.c.d nests objects and arrays 5 levels deep" in message


def test_too_many_tags_are_refused(secure: SecureApp) -> None:
    message = refused(
        secure, "/api/v1/create_session", json={"tags": ["t"] * (validation.MAX_TAGS + 1)}
    )
    assert "tags" in message and f"at most {validation.MAX_TAGS}" in message


# -- seeds and sampling parameters ------------------------------------------------------------


def test_seed_of_2_to_the_100_is_refused_in_sampling(secure: SecureApp, sampler_id: str) -> None:
    message = refused(secure, "/api/v1/asample", **sample(sampler_id, seed=2**100))
    assert "sampling_params.seed is an integer of 31 digits" in message


def test_seed_just_past_64_bits_is_refused(secure: SecureApp, sampler_id: str) -> None:
    message = refused(secure, "/api/v1/asample", **sample(sampler_id, seed=2**64))
    assert "sampling_params.seed" in message and str(2**64 - 1) in message


def test_lora_seed_of_2_to_the_100_is_refused(secure: SecureApp, session_id: str) -> None:
    body = {
        "session_id": session_id,
        "model_seq_id": 7,
        "base_model": "treadle/tiny-debug",
        "lora_config": {"rank": 4, "seed": 2**100},
    }
    message = refused(secure, "/api/v1/create_model", json=body)
    assert "lora_config.seed is an integer of 31 digits" in message


def test_temperature_of_1e308_is_refused(secure: SecureApp, sampler_id: str) -> None:
    message = refused(secure, "/api/v1/asample", **sample(sampler_id, temperature=1e308))
    assert "sampling_params.temperature" in message
    assert f"less than or equal to {validation.MAX_TEMPERATURE:g}" in message


def test_temperature_of_1e_300_is_refused(secure: SecureApp, sampler_id: str) -> None:
    message = refused(secure, "/api/v1/asample", **sample(sampler_id, temperature=1e-300))
    assert "sampling_params.temperature: 1e-300 is below" in message
    assert "use 0 for greedy decoding" in message


def test_top_p_of_1e_300_is_refused(secure: SecureApp, sampler_id: str) -> None:
    message = refused(secure, "/api/v1/asample", **sample(sampler_id, top_p=1e-300))
    assert f"sampling_params.top_p: 1e-300 is outside [{validation.MIN_TOP_P}, 1]" in message


def test_huge_top_k_is_refused(secure: SecureApp, sampler_id: str) -> None:
    message = refused(secure, "/api/v1/asample", **sample(sampler_id, top_k=2**40))
    assert "sampling_params.top_k" in message


def test_num_samples_times_max_tokens_over_the_bound_is_refused(
    secure: SecureApp, sampler_id: str
) -> None:
    request = sample(sampler_id, max_tokens=validation.MAX_SAMPLE_TOKENS // 64 + 1)
    request["json"]["num_samples"] = 64
    message = refused(secure, "/api/v1/asample", **request)
    assert "num_samples x sampling_params.max_tokens" in message
    assert f"at most {validation.MAX_SAMPLE_TOKENS}" in message


def test_too_many_stop_strings_are_refused(secure: SecureApp, sampler_id: str) -> None:
    stop = ["s"] * (validation.MAX_STOP + 1)
    message = refused(secure, "/api/v1/asample", **sample(sampler_id, stop=stop))
    assert f"sampling_params.stop: {validation.MAX_STOP + 1} entries" in message


def test_overlong_id_is_refused(secure: SecureApp) -> None:
    body = {"request_id": "r" * (validation.MAX_ID_LENGTH + 1)}
    message = refused(secure, "/api/v1/retrieve_future", json=body)
    assert f"request_id: String should have at most {validation.MAX_ID_LENGTH}" in message


# -- body size --------------------------------------------------------------------------------


def test_ten_megabyte_forward_backward_is_413_saying_the_limit(secure: SecureApp) -> None:
    limit = secure.app.extensions["treadle"].config.max_body_bytes
    message = refused(
        secure, "/api/v1/forward_backward", status=413, data=b"\0" * 10_000_000, headers=PROTO
    )
    assert f"limit of {limit} bytes" in message and "chunks of at most" in message


def test_ten_megabyte_json_body_is_413(secure: SecureApp) -> None:
    body = json.dumps({"tags": [], "user_metadata": {"x": "y" * 10_000_000}})
    message = refused(secure, "/api/v1/create_session", status=413, **raw_json(body))
    assert "TREADLE_MAX_BODY_BYTES" in message


def test_client_config_keeps_sdk_chunks_within_the_body_limit(secure: SecureApp) -> None:
    config = secure.app.extensions["treadle"].config
    answer = secure.call("POST", "/api/v1/client/config", secure.operator_key, json={})
    told = answer.get_json()
    assert told["fwdbwd_max_chunk_bytes_count"] == config.max_body_bytes // 2
    assert told["fwdbwd_max_chunk_len"] <= validation.MAX_DATUMS
    assert told["proto_compress_fwdbwd"] is False


def test_a_chunk_as_large_as_the_sdk_is_told_to_send_is_admitted(
    secure: SecureApp, session_id: str
) -> None:
    """Datums of a full context, packed as the tinker SDK packs a chunk (4 bytes a token plus
    each tensor's bytes, up to fwdbwd_max_chunk_bytes_count), make a body inside the limit."""
    config = secure.app.extensions["treadle"].config
    create = {"session_id": session_id, "model_seq_id": 1, "base_model": "treadle/tiny-debug"}
    model = secure.call("POST", "/api/v1/create_model", secure.operator_key, json=create)
    msg = pb.ForwardBackwardRequest(model_id=model.get_json()["model_id"], seq_id=1)
    msg.loss_fn = "cross_entropy"
    n = 2047  # tiny-debug's context is 2048
    estimate = n * (4 + 8 + 4)  # tokens, int64 target_tokens, float32 weights
    for _ in range(config.fwdbwd_chunk_bytes // estimate):
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = np.ones(n, dtype="<i4").tobytes()
        targets = np.ones(n, dtype="<i8").tobytes()
        datum.loss_fn_inputs["target_tokens"].CopyFrom(
            pb.Tensor(dtype=pb.DTYPE_INT64, shape=[n], dense=targets)
        )
        datum.loss_fn_inputs["weights"].CopyFrom(dense([n], [1.0] * n))
    body = msg.SerializeToString()
    assert config.fwdbwd_chunk_bytes * 0.9 < len(body) < config.max_body_bytes
    answer = secure.call(
        "POST", "/api/v1/forward_backward", secure.operator_key, data=body, headers=PROTO
    )
    assert answer.status_code == 200, answer.get_data(as_text=True)


# -- forward_backward tensors -----------------------------------------------------------------


def test_sparse_tensor_declaring_forty_million_values_is_refused(
    secure: SecureApp, model_id: str
) -> None:
    request = fwdbwd(model_id, ("weights", sparse([1, 40_000_000], [0, 0], [], [])))
    assert len(request["data"]) < 200
    message = refused(secure, "/api/v1/forward_backward", **request)
    assert "loss_fn_inputs['weights'] declares shape [1, 40000000]" in message
    assert f"at most {validation.MAX_VALUES_PER_TOKEN} values per token" in message


def test_dense_tensor_declaring_a_huge_shape_is_refused(secure: SecureApp, model_id: str) -> None:
    request = fwdbwd(model_id, ("weights", dense([40_000_000], [1.0, 1.0, 1.0])))
    message = refused(secure, "/api/v1/forward_backward", **request)
    assert "has 3 values but its shape [40000000] holds 40000000" in message


def test_dense_tensor_of_rank_three_is_refused(secure: SecureApp, model_id: str) -> None:
    request = fwdbwd(model_id, ("weights", dense([1, 1, 3], [1.0, 1.0, 1.0])))
    message = refused(secure, "/api/v1/forward_backward", **request)
    assert "loss_fn_inputs['weights'] has rank 3" in message


def test_negative_dimension_is_refused(secure: SecureApp, model_id: str) -> None:
    request = fwdbwd(model_id, ("weights", dense([-1], [1.0, 1.0, 1.0])))
    message = refused(secure, "/api/v1/forward_backward", **request)
    assert "a dimension cannot be negative" in message


SPARSE_CASES = [
    ("crow of the wrong length", sparse([3, 1], [0, 1], [0], [1.0]), "needs 4"),
    ("crow not starting at 0", sparse([1, 3], [1, 1], [], []), "must start at 0"),
    ("crow decreasing", sparse([2, 3], [0, 2, 1], [0], [1.0]), "never decrease"),
    ("crow past the columns", sparse([1, 3], [0, 9], [0], [1.0]), "end at the number of col_indices"),
    ("column out of range", sparse([1, 3], [0, 1], [5], [1.0]), "column index outside [0, 3)"),
    ("negative column", sparse([1, 3], [0, 1], [-1], [1.0]), "column index outside [0, 3)"),
    ("repeated column", sparse([1, 3], [0, 2], [1, 1], [1.0, 2.0]), "must increase within each row"),
    ("values and columns differ", sparse([1, 3], [0, 2], [0, 1], [1.0]), "1 values for 2 col_indices"),
    ("a 1-D sparse shape", sparse([3], [0, 1], [0], [1.0]), "needs a 2-D shape"),
    ("non-finite values", sparse([1, 3], [0, 1], [0], [float("inf")]), "NaN or infinity"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("tensor", "expected"), [c[1:] for c in SPARSE_CASES], ids=[c[0] for c in SPARSE_CASES]
)
def test_malformed_sparse_tensor_is_refused_before_densifying(
    secure: SecureApp, model_id: str, tensor: pb.Tensor, expected: str
) -> None:
    message = refused(secure, "/api/v1/forward_backward", **fwdbwd(model_id, ("weights", tensor)))
    assert "loss_fn_inputs['weights']" in message and expected in message


def test_tensor_refusal_is_recorded_as_the_refusal_of_its_seq_id(
    secure: SecureApp, model_id: str
) -> None:
    """The model id and seq_id are noted as soon as they are decoded, so the session's next
    operation does not wait for a seq_id refused for its tensors."""
    seq = 900
    refused(
        secure,
        "/api/v1/forward_backward",
        **fwdbwd(model_id, ("weights", dense([-1], [])), seq=seq),
    )
    with secure.engine.connect() as conn:
        recorded = conn.execute(
            sa.text("SELECT count(*) FROM refused_seqs WHERE session_id = :s AND seq_id = :q"),
            {"s": model_id, "q": seq},
        ).scalar_one()
    assert recorded == 1


def test_token_bytes_that_are_not_whole_int32s_are_refused(
    secure: SecureApp, model_id: str
) -> None:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    msg.data.add().model_input.add().encoded_text.tokens = b"\x01\x00\x00"
    message = refused(
        secure, "/api/v1/forward_backward", data=msg.SerializeToString(), headers=PROTO
    )
    assert "datum 0: model_input tokens has 3 bytes" in message


def test_more_datums_than_allowed_are_refused_before_parsing(
    secure: SecureApp, model_id: str
) -> None:
    head = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1).SerializeToString()
    body = head + b"\x1a\x00" * (validation.MAX_DATUMS + 1)  # field 3 (data), empty datums
    message = refused(secure, "/api/v1/forward_backward", data=body, headers=PROTO)
    assert f"more than {validation.MAX_DATUMS} datums" in message


def test_millions_of_empty_fields_are_refused_before_parsing(
    secure: SecureApp, model_id: str
) -> None:
    datum = b"\x0a\x00" * 3_000_000  # one datum of three million empty model_input chunks
    body = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1).SerializeToString()
    body += b"\x1a" + _varint(len(datum)) + datum
    message = refused(secure, "/api/v1/forward_backward", data=body, headers=PROTO)
    assert f"more than {validation.MAX_PROTO_FIELDS} protobuf fields" in message


def test_sparse_tensors_may_not_declare_more_than_the_body_carries(
    secure: SecureApp, model_id: str
) -> None:
    """Each tensor is within its per-token bound, but together they declare far more values than
    the body could carry densely."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    tokens = 256
    for _ in range(40):
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = np.ones(tokens, dtype="<i4").tobytes()
        for k in range(validation.MAX_LOSS_INPUTS):
            empty = sparse([tokens, validation.MAX_VALUES_PER_TOKEN], [0] * (tokens + 1), [], [])
            datum.loss_fn_inputs[f"extra{k}"].CopyFrom(empty)
    message = refused(
        secure, "/api/v1/forward_backward", data=msg.SerializeToString(), headers=PROTO
    )
    assert "a request may declare at most one value per 4 bytes of its body" in message


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
