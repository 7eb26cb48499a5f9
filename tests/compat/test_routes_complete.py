"""Every route the installed tinker SDK and its CLI can call has a handler in the app: the SDK's
source is scanned (its own `*_test.py` files left out) for every `"/api/v1/..."` path passed to
an HTTP call, f-strings included (each `{...}` segment stands for an id), with the call's method,
and each (method, path) must match a rule of the app's URL map. A new route in a future SDK
version fails this loudly, with the file and line that calls it."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import tinker
from werkzeug.exceptions import MethodNotAllowed, NotFound
from werkzeug.routing import RequestRedirect

from tests.secure_app import SecureApp

pytestmark = [pytest.mark.compat, pytest.mark.integration]

SDK = Path(tinker.__file__).resolve().parent
PREFIX = "/api/v1/"
# The HTTP call's method, by the name of the function called with the path.
METHODS = {
    name: name.lstrip("_").upper()
    for name in ("get", "post", "put", "patch", "delete", "_get", "_post", "_put", "_patch",
                 "_delete")
}  # fmt: skip
REQUEST_FUNCTIONS = {"request", "_request"}  # (method, path, ...)
# What an id segment stands for when the path is matched: a realistic value of each.
SAMPLE_IDS = {"checkpoint_id": "weights/step-1", "sampler_id": "sess-0123456789abcdef:sample:0"}
DEFAULT_ID = "sess-0123456789abcdef:train:0"
# Routes known to be in tinker 0.38.0: the scan must find at least these, so that a scan that
# finds nothing cannot pass.
KNOWN = {
    ("POST", "/api/v1/create_model"),
    ("POST", "/api/v1/retrieve_future"),
    ("POST", "/api/v1/retrieve_futures"),
    ("POST", "/api/v1/cancel_future"),
    ("POST", "/api/v1/copy_weights"),
    ("POST", "/api/v1/training_runs/{}/checkpoints/{}/publish"),
    ("DELETE", "/api/v1/training_runs/{}/checkpoints/{}/publish"),
    ("PUT", "/api/v1/sessions/{}/project"),
    ("GET", "/api/v1/auth/apikey/me"),
}


@dataclass(frozen=True)
class Call:
    method: str
    template: str  # `{}` for each id segment
    sample: str  # the path with realistic ids
    where: str  # file:line of the call


def _path(node: ast.expr) -> tuple[str, str] | None:
    """(template, sample) of a path literal or f-string starting with /api/v1/, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value, node.value) if node.value.startswith(PREFIX) else None
    if not isinstance(node, ast.JoinedStr) or not node.values:
        return None
    first = node.values[0]
    if not (isinstance(first, ast.Constant) and str(first.value).startswith(PREFIX)):
        return None
    template, sample = "", ""
    for part in node.values:
        if isinstance(part, ast.Constant):
            template += str(part.value)
            sample += str(part.value)
        else:
            assert isinstance(part, ast.FormattedValue)
            name = ast.unparse(part.value).split(".")[-1]
            template += "{}"
            sample += SAMPLE_IDS.get(name, DEFAULT_ID)
    return template, sample


def _method(call: ast.Call, position: int) -> str | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name in METHODS and position == 0:
        return METHODS[name]
    if name in REQUEST_FUNCTIONS and position == 1:
        verb = call.args[0]
        if isinstance(verb, ast.Constant) and isinstance(verb.value, str):
            return verb.value.upper()
    return None


def sdk_calls() -> tuple[list[Call], list[str]]:
    """Every HTTP call of the SDK's source with an /api/v1 path, and every /api/v1 path literal
    that is not a recognisable call's argument (each must be looked at by hand)."""
    calls: list[Call] = []
    placed: set[int] = set()
    loose: list[str] = []
    for file in sorted(SDK.rglob("*.py")):
        if file.name.endswith("_test.py"):
            continue
        tree = ast.parse(file.read_text(), str(file))
        where = str(file.relative_to(SDK.parent))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            for position, arg in enumerate(node.args):
                found = _path(arg)
                method = _method(node, position) if found else None
                if found is not None and method is not None:
                    calls.append(Call(method, found[0], found[1], f"{where}:{node.lineno}"))
                    placed.add(id(arg))
                    placed.update(id(v) for v in ast.walk(arg))
        for node in ast.walk(tree):
            if id(node) not in placed and isinstance(node, ast.Constant | ast.JoinedStr):
                found = _path(node)
                if found is not None:
                    loose.append(f"{where}:{node.lineno}: {found[0]}")
    return calls, loose


def test_the_scan_finds_the_sdks_routes() -> None:
    calls, loose = sdk_calls()
    assert loose == [], "an /api/v1 path outside an HTTP call: teach the scan its method"
    assert {(c.method, c.template) for c in calls} >= KNOWN
    assert len({(c.method, c.template) for c in calls}) >= 45


def test_every_sdk_route_has_a_handler(secure: SecureApp) -> None:
    adapter = secure.app.url_map.bind("localhost")
    missing: list[str] = []
    for call in sdk_calls()[0]:
        try:
            adapter.match(call.sample, method=call.method)
        except (NotFound, MethodNotAllowed, RequestRedirect) as exc:
            missing.append(f"{call.method} {call.template} ({call.where}): {type(exc).__name__}")
    assert missing == [], "routes the pinned tinker SDK calls that Treadle does not serve"


def test_publish_routes_are_not_taken_for_a_checkpoint_delete(secure: SecureApp) -> None:
    """`DELETE .../checkpoints/weights/x/publish` unpublishes: it is not the delete of a
    checkpoint named `weights/x/publish` (the checkpoint id itself holds a '/')."""
    adapter = secure.app.url_map.bind("localhost")
    run = "/api/v1/training_runs/sess-0123456789abcdef:train:0/checkpoints/weights/step-1"
    assert adapter.match(f"{run}/publish", method="DELETE")[0] == "checkpoint_sharing.unpublish"
    assert adapter.match(f"{run}/publish", method="POST")[0] == "checkpoint_sharing.publish"
    assert adapter.match(run, method="DELETE")[0] == "checkpoints.delete_checkpoint"
    urls = adapter.match(f"{run}/external_weights_urls", method="GET")[0]
    assert urls == "checkpoint_sharing.external_weights_urls"
