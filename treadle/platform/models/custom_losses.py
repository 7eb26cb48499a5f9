"""Server-side custom losses (`ServiceClient.create_custom_loss`): the rules an uploaded graph
must meet, its canonical content and the content-addressed id that names it.

A graph is the tinker SDK's `CustomLossGraph` (torch.fx nodes as plain data). It is checked node
by node against allowlists of torch / math / operator functions and torch.Tensor methods (the
engine rebuilds it from the same lists, `treadle.engine.losses.custom_graph`); anything else is a
ValidationError naming the node. The id is `closs-` + the sha256 of the canonical JSON of name,
inputs and nodes, so the same loss has one id per tenant and a forward_backward's event carries
the content that id names. Also the per-datum checks of a custom loss's inputs.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from treadle.platform.errors import ValidationError
from treadle.platform.models import validation
from treadle.platform.models.losses import LossSpec

__all__ = [
    "ALLOWED_ATTRIBUTES",
    "ALLOWED_DTYPES",
    "ALLOWED_FUNCTIONS",
    "ALLOWED_METHODS",
    "LOSS_ID_PREFIX",
    "TARGETS_ONLY",
    "canonical_json",
    "check_custom_datum",
    "loss_id_of",
    "validate_custom_forward_backward",
    "validate_loss",
]

LOSS_ID_PREFIX = "closs-"
MAX_NODES = 2000
MAX_ARG_DEPTH = 8
MAX_INPUTS = 16

# Elementwise, reduction and shape functions whose output is no larger than their inputs (no
# factory taking a size: a graph cannot ask for memory its data do not already hold).


def _names(text: str) -> list[str]:
    return text.split()


_TORCH = _names("""
abs absolute acos asin atan atan2 ceil clamp clamp_max clamp_min clip cos cosh cumsum diff div
divide dot eq erf exp exp2 expm1 flatten floor fmod full_like ge gt isfinite isinf isnan le lerp
lgamma log log10 log1p log2 log_softmax logaddexp logical_and logical_not logical_or logsumexp
lt masked_fill matmul max maximum mean min minimum mul multiply nan_to_num ne neg negative
ones_like pow prod reciprocal relu remainder round rsqrt sigmoid sign sin sinh softmax sqrt
square squeeze stack std sub subtract sum tanh transpose trunc unsqueeze var where xlogy
zeros_like cat gather amax amin argmax argmin any all count_nonzero numel sort topk reshape
""")
_FUNCTIONAL = _names("""
logsigmoid softplus relu sigmoid tanh log_softmax softmax cross_entropy nll_loss
mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy_with_logits kl_div
""")
# where torch.fx finds F.logsigmoid & co: the C functions behind them
_C_NN = _names("log_sigmoid softplus mse_loss l1_loss smooth_l1_loss huber_loss")
_MATH = _names("exp log log1p log2 log10 sqrt pow tanh fabs floor ceil")
_OPERATOR = _names("""
add sub mul truediv floordiv mod pow neg pos abs invert lt le gt ge eq ne and_ or_ xor
getitem matmul
""")

ALLOWED_FUNCTIONS: frozenset[str] = frozenset(
    [f"torch.{n}" for n in _TORCH]
    + [f"torch.nn.functional.{n}" for n in _FUNCTIONAL]
    + [f"torch._C._nn.{n}" for n in _C_NN]
    + [f"math.{n}" for n in _MATH]
    + [f"operator.{n}" for n in _OPERATOR]
    + ["getattr"]
)
ALLOWED_METHODS: frozenset[str] = frozenset(
    _names("""
abs add amax amin any all argmax argmin clamp clamp_max clamp_min clip cos cumsum detach dim div
dot double eq exp expm1 flatten float ge gt isfinite isnan le log log1p log2 log_softmax
logsumexp lt masked_fill matmul max mean min mul ne neg numel pow prod reciprocal relu reshape
rsqrt sigmoid sign sin size softmax sqrt square squeeze std sub sum t tanh to transpose
type_as unsqueeze var view view_as where gather sort topk nan_to_num exp2 float_power
""")
)
# getattr(tensor, name): only these attributes of a node (never of a module).
ALLOWED_ATTRIBUTES: frozenset[str] = frozenset({"shape", "ndim", "dtype", "T", "mT"})
ALLOWED_DTYPES: frozenset[str] = frozenset({"float32", "float64", "int64", "int32", "bool"})

_NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_LOSS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.<>-]{0,127}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_OPS = ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")


def validate_loss(name: Any, inputs: Any, graph: Any) -> dict[str, Any]:
    """Check an uploaded loss and return its canonical content `{name, inputs, nodes}`.

    Raises ValidationError naming the first node (or input) that breaks a rule.
    """
    if not isinstance(name, str) or not _LOSS_NAME.fullmatch(name):
        raise ValidationError(f"custom loss name {str(name)[:80]!r} must be a Python identifier")
    checked_inputs = _inputs(inputs)
    if not isinstance(graph, Mapping) or graph.get("format") != 1:
        raise ValidationError("graph.format must be 1 (the tinker SDK's CustomLossGraph format)")
    nodes = graph.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ValidationError("graph.nodes must be a non-empty list")
    if len(nodes) > MAX_NODES:
        raise ValidationError(
            f"graph has {len(nodes)} nodes; a custom loss has at most {MAX_NODES}"
        )
    seen: set[str] = set()
    out = [_node(i, node, seen, checked_inputs) for i, node in enumerate(nodes)]
    placeholders = [n["name"] for n in out if n["op"] == "placeholder"]
    if placeholders != [x["name"] for x in checked_inputs]:
        raise ValidationError(
            f"graph placeholders {placeholders} must be the inputs in order "
            f"{[x['name'] for x in checked_inputs]}"
        )
    if out[-1]["op"] != "output" or sum(n["op"] == "output" for n in out) != 1:
        raise ValidationError("graph must end with its one output node")
    _check_output(out[-1])
    return {"name": name, "inputs": checked_inputs, "nodes": out}


def canonical_json(content: Mapping[str, Any]) -> bytes:
    """The bytes a loss's id hashes: sorted keys, no spaces."""
    return json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def loss_id_of(content: Mapping[str, Any]) -> str:
    return LOSS_ID_PREFIX + hashlib.sha256(canonical_json(content)).hexdigest()


def _inputs(inputs: Any) -> list[dict[str, Any]]:
    if not isinstance(inputs, list) or not inputs or len(inputs) > MAX_INPUTS:
        raise ValidationError(f"inputs must list 1 to {MAX_INPUTS} inputs, logprobs first")
    out: list[dict[str, Any]] = []
    for i, x in enumerate(inputs):
        name = x.get("name") if isinstance(x, Mapping) else None
        rank = x.get("rank") if isinstance(x, Mapping) else None
        if not isinstance(name, str) or not _INPUT_NAME.fullmatch(name):
            raise ValidationError(f"inputs[{i}].name must be a lowercase identifier")
        if rank not in (0, 1, 2) or isinstance(rank, bool):
            raise ValidationError(f"inputs[{i}] ({name}): rank must be 0, 1 or 2")
        if rank == 2:
            raise ValidationError(
                f"inputs[{i}] ({name}) has rank 2 ([T, K]); this server takes rank-0 and "
                "rank-1 custom loss inputs only (2-D target_tokens are not served yet)"
            )
        out.append({"name": name, "rank": rank})
    if out[0]["name"] != "logprobs" or out[0]["rank"] != 1:
        raise ValidationError("inputs[0] must be logprobs with rank 1")
    names = [x["name"] for x in out]
    if len(set(names)) != len(names) or "target_tokens" in names[1:]:
        raise ValidationError(f"inputs {names} must be distinct and not target_tokens")
    return out


def _node(i: int, node: Any, seen: set[str], inputs: list[dict[str, Any]]) -> dict[str, Any]:
    if not isinstance(node, Mapping) or set(node) - {"op", "name", "target", "args", "kwargs"}:
        raise ValidationError(f"graph node {i} must be an object of op, name, target, args, kwargs")
    op, name, target = node.get("op"), node.get("name"), node.get("target")
    if not isinstance(name, str) or not _NODE_NAME.fullmatch(name) or name in seen:
        raise ValidationError(f"graph node {i}: name {str(name)[:80]!r} must be a new identifier")
    label = f"graph node {name!r}"
    if op not in _OPS or not isinstance(target, str):
        raise ValidationError(f"{label}: op must be one of {', '.join(_OPS)}, target a string")
    args, kwargs = node.get("args", []), node.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, Mapping):
        raise ValidationError(f"{label}: args must be a list and kwargs an object")
    if op in ("get_attr", "call_module"):
        raise ValidationError(
            f"{label} ({op} {target[:80]!r}) is not allowed: a custom loss may read only its "
            "inputs and call torch / math / operator functions and torch.Tensor methods"
        )
    if op == "placeholder" and (args or kwargs or target != name):
        raise ValidationError(f"{label}: a placeholder takes no arguments and is named its target")
    if op == "call_function" and target not in ALLOWED_FUNCTIONS:
        raise ValidationError(
            f"{label} calls {target[:120]!r}, which a custom loss may not call; allowed are "
            "the torch / torch.nn.functional / math / operator functions docs/tinker-"
            "compatibility.md lists"
        )
    if op == "call_method" and target not in ALLOWED_METHODS:
        raise ValidationError(
            f"{label} calls method {target[:120]!r}, which a custom loss may not call; allowed "
            "are the torch.Tensor methods docs/tinker-compatibility.md lists"
        )
    if op == "call_method" and not (args and _is_ref(args[0])):
        raise ValidationError(f"{label}: a method is called on a node, its first argument")
    if (
        op == "call_function"
        and target == "getattr"
        and (len(args) != 2 or kwargs or not _is_ref(args[0]) or args[1] not in ALLOWED_ATTRIBUTES)
    ):
        raise ValidationError(
            f"{label}: getattr reads only {sorted(ALLOWED_ATTRIBUTES)} of a tensor node"
        )
    if (
        op == "call_method"
        and target == "to"
        and (
            any(not (_is_ref(a) or (isinstance(a, Mapping) and set(a) == {"dtype"})) for a in args)
            or set(kwargs) - {"dtype"}
        )
    ):
        raise ValidationError(f"{label}: .to() takes a dtype only; the server places tensors")
    if op == "output" and (len(args) != 1 or kwargs):
        raise ValidationError(f"{label}: an output node has exactly one argument")
    checked_args = [_arg(label, a, seen, 0) for a in args]
    checked_kwargs = {str(k): _arg(label, v, seen, 0) for k, v in kwargs.items()}
    seen.add(name)
    return {
        "op": op,
        "name": name,
        "target": target,
        "args": checked_args,
        "kwargs": checked_kwargs,
    }


def _is_ref(value: Any) -> bool:
    return isinstance(value, Mapping) and set(value) == {"ref"}


def _arg(label: str, value: Any, seen: set[str], depth: int) -> Any:
    """An encoded argument, checked: refs to earlier nodes, finite JSON numbers, allowed dtypes."""
    if depth > MAX_ARG_DEPTH:
        raise ValidationError(f"{label}: arguments nest deeper than {MAX_ARG_DEPTH}")
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, str) and len(value) > 128:
            raise ValidationError(f"{label}: a string argument is longer than 128 characters")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValidationError(f"{label}: a non-finite number must be sent as {{'float': ...}}")
        return value
    if isinstance(value, list):
        return [_arg(label, v, seen, depth + 1) for v in value]
    if not isinstance(value, Mapping) or len(value) != 1:
        raise ValidationError(f"{label}: argument {str(value)[:80]} is not an encoded value")
    ((kind, inner),) = value.items()
    if kind == "ref":
        if inner not in seen:
            raise ValidationError(f"{label} refers to {str(inner)[:80]!r}, not an earlier node")
        return {"ref": inner}
    if kind == "tuple" and isinstance(inner, list):
        return {"tuple": [_arg(label, v, seen, depth + 1) for v in inner]}
    if kind == "dict" and isinstance(inner, Mapping):
        return {"dict": {str(k): _arg(label, v, seen, depth + 1) for k, v in inner.items()}}
    if kind == "slice" and isinstance(inner, list) and len(inner) == 3:
        return {"slice": [_arg(label, v, seen, depth + 1) for v in inner]}
    if kind == "ellipsis" and inner is True:
        return {"ellipsis": True}
    if kind == "float" and inner in ("inf", "-inf", "nan"):
        return {"float": inner}
    if kind == "dtype" and inner in ALLOWED_DTYPES:
        return {"dtype": inner}
    raise ValidationError(
        f"{label}: argument {{{kind!r}: ...}} is not allowed (dtypes: {sorted(ALLOWED_DTYPES)}; "
        "devices, layouts and memory formats are the server's to choose)"
    )


def _check_output(node: Mapping[str, Any]) -> None:
    result = node["args"][0]
    parts = result.get("tuple") if isinstance(result, Mapping) else result
    if not (isinstance(parts, list) and len(parts) == 2 and _is_ref(parts[0])):
        raise ValidationError("the output node must return (loss node, {metric: node})")
    metrics = parts[1].get("dict") if isinstance(parts[1], Mapping) else None
    if not isinstance(metrics, Mapping):
        raise ValidationError("the output node's metrics must be a dict of nodes")
    for key, value in metrics.items():
        if not _METRIC_KEY.fullmatch(key) or not _is_ref(value):
            raise ValidationError(
                f"metric {key[:80]!r} must be named custom/<name>:sum or :mean and be a node"
            )


def check_custom_datum(
    i: int,
    n_tokens: int,
    inputs: Mapping[str, np.ndarray],
    loss_inputs: Sequence[Mapping[str, Any]],
) -> dict[str, np.ndarray]:
    """Datum `i`'s arrays for a custom loss: `target_tokens` (checked by the caller) and each
    input the loss declares, finite float32 of its rank (rank 1: one value per token; rank 0:
    one value). Inputs the loss does not read are dropped."""
    arrays: dict[str, np.ndarray] = {}
    for x in loss_inputs[1:]:
        name, rank = x["name"], x["rank"]
        if name not in inputs:
            raise ValidationError(
                f"datum {i}: loss_fn_inputs has no {name!r}, which the custom loss reads"
            )
        value = np.asarray(inputs[name])
        if value.dtype.kind not in "fiu":
            raise ValidationError(f"datum {i}: {name} must hold numbers")
        value = value.astype(np.float32)
        if rank == 1 and value.shape != (n_tokens,):
            raise ValidationError(
                f"datum {i}: {name} has shape {list(value.shape)}; the custom loss declares it "
                f"rank 1, one value per token ({n_tokens})"
            )
        if rank == 0:
            if value.size != 1:
                raise ValidationError(
                    f"datum {i}: {name} has {value.size} values; the custom loss declares it "
                    "rank 0, one value"
                )
            value = value.reshape(())
        if not np.all(np.isfinite(value)):
            raise ValidationError(f"datum {i}: {name} holds a non-finite value")
        arrays[name] = value
    return arrays


# What check_datum holds a custom loss's datum to: its tokens and target_tokens.
TARGETS_ONLY = LossSpec("custom", ())


def validate_custom_forward_backward(
    payload: dict[str, Any], model: validation.ModelLimits, loss: Mapping[str, Any]
) -> None:
    """Check a decoded forward_backward payload for the custom loss `loss` (`validate_loss`'s
    content) and keep in each datum only `target_tokens` and the inputs the loss reads, a
    rank-0 input as shape [] (what the operation records)."""
    data = payload["data"]
    if not data:
        raise ValidationError("forward_backward needs at least one datum")
    if len(data) > validation.MAX_DATUMS:
        raise ValidationError(
            f"{len(data)} datums in one request; send at most {validation.MAX_DATUMS}"
        )
    for i, datum in enumerate(data):
        tensors = datum["loss_fn_inputs"]
        if "target_tokens" not in tensors:
            raise ValidationError(f"datum {i}: loss_fn_inputs has no target_tokens")
        tokens = np.asarray(datum["tokens"], np.int64)
        targets = {
            "target_tokens": validation.tensor_array(i, "target_tokens", tensors["target_tokens"])
        }
        validation.check_datum(i, tokens, targets, TARGETS_ONLY, model)
        read = [x for x in loss["inputs"][1:] if x["name"] in tensors]
        arrays = check_custom_datum(
            i,
            tokens.size,
            {x["name"]: validation.tensor_array(i, x["name"], tensors[x["name"]]) for x in read},
            loss["inputs"],
        )
        kept = {"target_tokens": tensors["target_tokens"]}
        for name, array in arrays.items():
            kept[name] = {
                "dtype": "float32",
                "shape": list(array.shape),
                "data": array.ravel().tolist(),
            }
        datum["loss_fn_inputs"] = kept
    payload["loss_fn_config"] = {}
