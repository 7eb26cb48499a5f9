"""Server-side custom losses: a recorded `CustomLoss` (create_custom_loss's graph) rebuilt from
the platform's allowlists and run on each datum's logprobs in the forward_backward's own pass.

The graph is re-checked (`platform.models.custom_losses.validate_loss`) and every target is
looked up by its allowed dotted name from the torch / math / operator modules, never imported
or evaluated; nodes run in order, as torch.fx's own code would run them, so the loss, its
metrics and (through autograd) its gradient are what the SDK's client-side path computes from
the same logprobs. Per datum: `(logprobs [T], *inputs) -> (scalar loss, {metric: scalar})`.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treadle.platform.errors import ValidationError
from treadle.platform.models import custom_losses

__all__ = ["METRIC_PREFIX", "VALUES_PER_TOKEN", "CustomLossGraph", "build"]

# Per-datum metric values ride in a datum's outputs under this prefix until the engine sums
# them (`metrics`); the client never sees these keys.
METRIC_PREFIX = "metric:"

# The most values any tensor a graph computes may hold, per token of its datum: a loss works
# on per-token values, so a broadcast into [T, T] and beyond (memory the engine did not plan
# for) is refused rather than run.
VALUES_PER_TOKEN = 64

_ROOTS: dict[str, Any] = {"torch": torch, "math": math, "operator": operator}


def _resolve(target: str) -> Callable[..., Any]:
    if target == "getattr":
        return builtins.getattr
    root, *path = target.split(".")
    value = _ROOTS[root]
    for part in path:
        value = getattr(value, part)
    if not callable(value):
        raise ValidationError(f"{target!r} is not a function here")
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True)
class CustomLossGraph:
    """A checked loss: its inputs (logprobs first) and nodes with their functions resolved."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[dict[str, Any], ...]
    functions: Mapping[str, Callable[..., Any]]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The loss_fn_inputs it reads, after logprobs."""
        return tuple(name for name, _ in self.inputs[1:])

    def run(
        self, logprobs_T: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The datum's loss (a scalar) and metrics, from its logprobs and inputs."""
        env: dict[str, Any] = {}
        limit = VALUES_PER_TOKEN * max(1, logprobs_T.numel())
        values = [logprobs_T, *(inputs[name] for name in self.input_names)]
        placeholders = iter(values)
        for node in self.nodes:
            op, name = node["op"], node["name"]
            if op == "placeholder":
                env[name] = next(placeholders)
                continue
            args = [_decode(a, env) for a in node["args"]]
            kwargs = {k: _decode(v, env) for k, v in node["kwargs"].items()}
            if op == "output":
                loss, metrics = args[0]
                return _checked(self.name, loss, metrics)
            if op == "call_function":
                value = self.functions[name](*args, **kwargs)
            else:  # call_method, on a value the graph computed: allowed names only
                value = getattr(args[0], node["target"])(*args[1:], **kwargs)
            if isinstance(value, torch.Tensor) and value.numel() > limit:
                raise ValidationError(
                    f"loss {self.name!r}: graph node {name!r} made a tensor of shape "
                    f"{list(value.shape)}; a custom loss's values hold at most {limit} "
                    f"({VALUES_PER_TOKEN} per token of the datum)"
                )
            env[name] = value
        raise AssertionError("a checked graph ends with its output node")


def build(recorded: Mapping[str, Any]) -> CustomLossGraph:
    """The loss a forward_backward's event records (`optypes.CustomLoss` as JSON), checked and
    resolved; ValidationError naming the node where it breaks a rule."""
    content = custom_losses.validate_loss(
        recorded["name"],
        [dict(x) for x in recorded["inputs"]],
        {"format": 1, "nodes": list(recorded["nodes"])},
    )
    if custom_losses.loss_id_of(content) != recorded["loss_id"]:
        raise ValidationError(f"custom loss {recorded['loss_id']!r} does not match its content")
    functions: dict[str, Callable[..., Any]] = {}
    for node in content["nodes"]:
        if node["op"] == "call_function":
            try:
                functions[node["name"]] = _resolve(node["target"])
            except AttributeError as exc:
                raise ValidationError(
                    f"graph node {node['name']!r} calls {node['target']!r}, which this server's "
                    "torch does not have"
                ) from exc
    return CustomLossGraph(
        name=content["name"],
        inputs=tuple((x["name"], x["rank"]) for x in content["inputs"]),
        nodes=tuple(content["nodes"]),
        functions=functions,
    )


def _decode(value: Any, env: Mapping[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if not isinstance(value, dict):
        return value
    ((kind, inner),) = value.items()
    if kind == "ref":
        return env[inner]
    if kind == "tuple":
        return tuple(_decode(v, env) for v in inner)
    if kind == "dict":
        return {k: _decode(v, env) for k, v in inner.items()}
    if kind == "slice":
        return slice(*(_decode(v, env) for v in inner))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(inner)
    assert kind == "dtype", kind  # the platform's check allows nothing else
    return getattr(torch, inner)


def _checked(
    name: str, loss: Any, metrics: Mapping[str, Any]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValidationError(f"loss {name!r} must return a scalar loss, got {shape}")
    out: dict[str, torch.Tensor] = {}
    for key, value in metrics.items():
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ValidationError(f"loss {name!r}: metric {key!r} must be a scalar tensor")
        out[key] = value
    return loss, out


def datum_outputs(
    graph: CustomLossGraph,
    logprobs_T: torch.Tensor,
    arrays: Mapping[str, np.ndarray],
    device: torch.device,
) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """Run `graph` on one datum: its loss, and its metrics as 0-d arrays under METRIC_PREFIX."""
    inputs = {name: torch.from_numpy(arrays[name]).to(device) for name in graph.input_names}
    loss, metrics = graph.run(logprobs_T, inputs)
    return loss, {
        METRIC_PREFIX + key: np.asarray(float(value.detach().float().reshape(())), np.float64)
        for key, value in metrics.items()
    }


def reduce_metrics(outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Pop each datum's metrics from `outputs` and combine them as the SDK does: `:sum` summed,
    `:mean` summed then divided by the number of datums."""
    sums: dict[str, float] = {}
    for out in outputs:
        for key in [k for k in out if k.startswith(METRIC_PREFIX)]:
            metric = key.removeprefix(METRIC_PREFIX)
            sums[metric] = sums.get(metric, 0.0) + float(out.pop(key))
    return {k: v / len(outputs) if k.endswith(":mean") else v for k, v in sums.items()}
