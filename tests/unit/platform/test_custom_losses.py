"""The rules an uploaded custom loss graph meets (`platform.models.custom_losses`): the SDK's own
encoding of a traced loss passes; each broken rule is a ValidationError naming what broke it."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from treadle.platform.errors import ValidationError
from treadle.platform.models import custom_losses

RANKS: dict[str, Any] = {"logprobs": 1, "weights": 1}
INPUTS = [{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 1}]


def weighted(logprobs, weights):  # type: ignore[no-untyped-def]
    loss = -(logprobs * weights).sum().clamp(min=-1e9).to(torch.float32)
    return loss, {"custom/nll:sum": loss}


def graph() -> dict[str, Any]:
    return encode_graph(trace_loss(weighted, RANKS, "s")).model_dump(mode="json")


def node(g: dict[str, Any], name: str) -> dict[str, Any]:
    return next(n for n in g["nodes"] if n["name"] == name)


def test_the_sdk_encoding_of_a_traced_loss_passes_and_has_a_stable_id() -> None:
    content = custom_losses.validate_loss("weighted", INPUTS, graph())
    again = custom_losses.validate_loss("weighted", copy.deepcopy(INPUTS), graph())
    assert custom_losses.loss_id_of(content) == custom_losses.loss_id_of(again)
    assert custom_losses.loss_id_of(content).startswith("closs-")


def _mutate(change: Any) -> dict[str, Any]:
    g = graph()
    change(g)
    return g


@pytest.mark.parametrize(
    ("inputs", "g", "message"),
    [
        ([{"name": "logprobs", "rank": 2}], graph(), "rank 2"),
        ([{"name": "weights", "rank": 1}, {"name": "logprobs", "rank": 1}], graph(), "logprobs"),
        (INPUTS, _mutate(lambda g: node(g, "mul").update(args=[{"ref": "sum_1"}, 1])), "'sum_1'"),
        (INPUTS, _mutate(lambda g: node(g, "to").update(args=[{"ref": "clamp"}, "cuda:1"])), ".to()"),
        (INPUTS, _mutate(lambda g: node(g, "mul").update(args=[{"ref": "logprobs"}, {"device": "cpu"}])), "device"),
        (INPUTS, _mutate(lambda g: g["nodes"][-1]["args"][0]["tuple"][1]["dict"].update({"x": {"ref": "neg"}})), "custom/<name>"),
        (INPUTS, _mutate(lambda g: g["nodes"].append(dict(g["nodes"][-1], name="output_2"))), "output"),
        (INPUTS, _mutate(lambda g: node(g, "mul").update(target="torch.Tensor.__setattr__")), "torch.Tensor.__setattr__"),
        (INPUTS, _mutate(lambda g: node(g, "mul").update(target="torch.zeros")), "'mul' calls 'torch.zeros'"),
    ],
    ids=["rank-2", "order", "later-ref", "to-device-string", "device", "metric-key", "two-outputs", "dunder", "factory"],
)  # fmt: skip
def test_a_graph_breaking_a_rule_is_refused_naming_it(
    inputs: list[dict[str, Any]], g: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        custom_losses.validate_loss("weighted", inputs, g)
