"""Property-based fuzzing (hypothesis) of every JSON route: no body makes the API answer a 5xx,
and a refused body (a 4xx) appends nothing to the event log.

Bodies for a route that parses a request model (the models the views use, as
`treadle.api.openapi.ROUTES` names them) are derived from that model: each field absent, valid,
at or just past its bounds, or any JSON value, with real ids mixed in so requests get past the
lookups into validation and admission; every POST/PUT route of the URL map also gets arbitrary
JSON. NaN, Infinity, overflowing floats and integers of any size are sent as the literals a
hostile client would write. Examples are derandomized so CI cannot flake; every fixture is
module- or session-scoped, so hypothesis' function-scoped-fixture health check never applies.
"""

from __future__ import annotations

import json
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tests.secure_app import SecureApp
from treadle.api.openapi import ROUTES

pytestmark = pytest.mark.integration

JSON = {"Content-Type": "application/json"}
MODEL_ROUTES = sorted(name for name, doc in ROUTES.items() if doc.body is not None)
FUZZ = settings(max_examples=20, deadline=None, derandomize=True, database=None)

leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**90), max_value=2**90)
    | st.floats()  # NaN and infinities included: json.dumps writes them as literals
    | st.sampled_from([1e308, -1e308, 1e-300, 5e-324, 2.0**64])
    | st.text(max_size=24)
)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)


class Ids:
    """Real ids of this module's client session, model and sampler, so fuzzed requests reach
    validation and admission instead of stopping at a 404."""

    def __init__(self, secure: SecureApp) -> None:
        key = secure.operator_key
        self.session = secure.call("POST", "/api/v1/create_session", key, json={}).get_json()[
            "session_id"
        ]
        model = {"session_id": self.session, "model_seq_id": 0, "base_model": "treadle/tiny-debug"}
        self.model = secure.call("POST", "/api/v1/create_model", key, json=model).get_json()[
            "model_id"
        ]
        sampler = {
            "session_id": self.session,
            "sampling_session_seq_id": 0,
            "base_model": "treadle/tiny-debug",
        }
        self.sampler = secure.call(
            "POST", "/api/v1/create_sampling_session", key, json=sampler
        ).get_json()["sampling_session_id"]
        # What a field of this name holds in a request the route admits (the routes check more
        # than the models say: unsupported options must be 0 or absent).
        self.hints: dict[str, Any] = {
            "session_id": self.session,
            "model_id": self.model,
            "sampling_session_id": self.sampler,
            "base_model": "treadle/tiny-debug",
            "path": "fuzzed",
            "tinker_path": f"tinker://{self.model}/weights/fuzzed",
            "kind": "snapshot",
            "type": "encoded_text",
            "topk_sample_logprobs": 0,
            "prompt_alt_tokens_k": 0,
            "prompt_logprobs_last_n": None,
            "optimizer_params": None,
        }

    def strings(self) -> st.SearchStrategy[str]:
        return st.sampled_from([self.session, self.model, self.sampler, "missing", ""]) | st.text(
            max_size=24
        )


@pytest.fixture(scope="module")
def ids(secure: SecureApp) -> Ids:
    secure.keep_worker_alive()
    return Ids(secure)


def _bounds(info: FieldInfo | None, metadata: list[Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    extra = info.json_schema_extra if info is not None else None
    if isinstance(extra, dict):  # bounds a custom validator enforces, as the schema states them
        found.update(low=extra.get("minimum"), high=extra.get("maximum"))
    for item in metadata:
        if isinstance(item, FieldInfo):
            found.update(_bounds(None, item.metadata))
        elif isinstance(item, at.Ge | at.Gt):
            found["low"] = item.ge if isinstance(item, at.Ge) else item.gt
        elif isinstance(item, at.Le | at.Lt):
            found["high"] = item.le if isinstance(item, at.Le) else item.lt
        elif isinstance(item, at.MaxLen):
            found["max_len"] = item.max_length
    return {k: v for k, v in found.items() if v is not None}


def valid(name: str, annotation: Any, info: FieldInfo | None, metadata: list[Any], ids: Ids) -> Any:
    """Values a field of this annotation accepts (mostly): inside its bounds, real ids."""
    if name in ids.hints:
        return st.just(ids.hints[name])
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *extra = get_args(annotation)
        return valid(name, base, info, [*metadata, *extra], ids)
    if origin in (Union, types.UnionType):
        return st.one_of([valid(name, arg, info, metadata, ids) for arg in get_args(annotation)])
    if origin is Literal:
        return st.sampled_from(get_args(annotation))
    if annotation is type(None):
        return st.none()
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return bodies(annotation, ids, spoil=False)  # spoiled at the top level only
    bounds = _bounds(info, metadata)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        low = bounds.get("low", 0)
        return st.integers(min_value=low, max_value=min(bounds.get("high", 64), low + 64))
    if annotation is float:
        return st.floats(min_value=bounds.get("low", 0.0), max_value=bounds.get("high", 2.0))
    if annotation is str:
        return ids.strings()
    if origin is list:
        (item,) = get_args(annotation)
        return st.lists(valid("", item, None, [], ids), min_size=1, max_size=4)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)
    return json_values  # Any


def hostile(annotation: Any, info: FieldInfo | None, metadata: list[Any]) -> Any:
    """Values at and past the field's bounds, of the wrong type, or any JSON value."""
    bounds = _bounds(info, metadata)
    edges: list[Any] = [2**63, 2**64, 2**100, -(2**64), 1e308, 1e-300, -1.0, "x" * 600]
    for key in ("low", "high"):
        if key in bounds:
            edges += [bounds[key], bounds[key] * 2 - 1, -bounds[key]]
    if "max_len" in bounds:
        edges += ["y" * bounds["max_len"], "y" * (bounds["max_len"] + 1)]
    return st.sampled_from(edges) | json_values


def bodies(model: type[BaseModel], ids: Ids, *, spoil: bool = True) -> Any:
    """A valid-looking object for `model` (its required fields and the ones naming real ids
    present, the others maybe), and with `spoil`, also that object with one field made hostile
    or an unknown key added."""
    fields = model.model_fields
    values = {
        name: valid(name, f.annotation, f, list(f.metadata), ids) for name, f in fields.items()
    }
    always = {n for n, f in fields.items() if f.is_required() or n in ids.hints}
    base = st.fixed_dictionaries(
        {n: v for n, v in values.items() if n in always},
        optional={n: v for n, v in values.items() if n not in always},
    )
    if not spoil:
        return base
    spoilers = {name: hostile(f.annotation, f, list(f.metadata)) for name, f in fields.items()} | {
        "unknown": json_values
    }

    def spoiled(body: dict[str, Any]) -> Any:
        return st.sampled_from(sorted(spoilers)).flatmap(
            lambda name: spoilers[name].map(lambda value: {**body, name: value})
        )

    return base | base.flatmap(spoiled)


def _url(rule: Any) -> str:
    """The rule's URL with its parameters filled by placeholders (never a live session: a
    finished session or stopped model would starve the other examples)."""
    return rule.rule.replace("<path:", "<").replace("<", "").replace(">", "-missing")


def _send(secure: SecureApp, method: str, url: str, payload: Any) -> None:
    secure.keep_worker_alive()
    text = json.dumps(payload)  # allow_nan: NaN, Infinity and -Infinity go out as literals
    before = secure.event_count()
    answer = secure.call(method, url, secure.operator_key, data=text.encode(), headers=JSON)
    assert answer.status_code < 500, (url, text[:500], answer.get_data(as_text=True)[:500])
    if 400 <= answer.status_code < 500:
        assert secure.event_count() == before, (url, text[:500], answer.status_code)


@pytest.mark.parametrize("endpoint", MODEL_ROUTES)
def test_fuzzed_model_bodies_never_reach_a_5xx_and_refusals_append_nothing(
    secure: SecureApp, ids: Ids, endpoint: str
) -> None:
    model = ROUTES[endpoint].body
    assert model is not None
    rule = next(r for r in secure.app.url_map.iter_rules() if r.endpoint == endpoint)
    method = sorted((rule.methods or set()) & {"POST", "PUT", "PATCH"})[0]

    @FUZZ
    @given(payload=bodies(model, ids) | json_values)
    def check(payload: Any) -> None:
        _send(secure, method, _url(rule), payload)

    check()


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_arbitrary_json_on_every_route_never_reaches_a_5xx(
    secure: SecureApp, ids: Ids, data: st.DataObject
) -> None:
    routes = sorted(
        (rule.rule, method)
        for rule in secure.app.url_map.iter_rules()
        if rule.endpoint != "training.forward_backward"  # protobuf: test_hostile_input.py
        for method in (rule.methods or set()) & {"POST", "PUT", "PATCH"}
    )
    path, method = data.draw(st.sampled_from(routes))
    rule = next(r for r in secure.app.url_map.iter_rules() if r.rule == path)
    _send(secure, method, _url(rule), data.draw(json_values))
