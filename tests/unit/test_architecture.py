"""The import rules of ARCHITECTURE.md (no import cycles, each package's allowed imports), and
the client's install footprint."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2] / "treadle"

FORBIDDEN = {
    "client": (
        "flask",
        "sqlalchemy",
        "celery",
        "torch",
        "treadle.platform",
        "treadle.api",
        "treadle.engine",
        "treadle.worker",
    ),
    "platform": ("treadle.api", "treadle.engine", "treadle.worker", "flask", "torch"),
    "api": ("torch", "treadle.engine", "treadle.worker", "transformers", "peft"),
    # Compute only: no process, no service (rule 1 of docs/design.md's engine; its platform
    # imports are ENGINE_PLATFORM's).
    "engine": (
        "treadle.api",
        "treadle.worker",
        "flask",
        "sqlalchemy",
        "celery",
        "redis",
        "prometheus_client",
    ),
    "worker": ("treadle.api", "flask"),
    # Recipes are user code: the SDKs and their own modules. Only --embedded reaches for the
    # platform (treadle.platform.embedded.free_port, to start `treadle up`).
    "recipes": (
        "treadle.api",
        "treadle.engine",
        "treadle.worker",
        "flask",
        "sqlalchemy",
        "celery",
    ),
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _treadle_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of `treadle` that `path` imports, wherever the import stands (a function's
    body and `if TYPE_CHECKING:` included): `from package import name` names the module
    `package.name` where there is one."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in known}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the treadle modules it imports."""
    paths = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    return {name: _treadle_imports(path, name, set(paths)) - {name} for name, path in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_module_imports_itself_in_a_cycle() -> None:
    """No import cycle anywhere in treadle/, not even through an import inside a function or
    one for type checking only: each cycle names its modules."""
    assert import_cycles(import_graph()) == []


def test_a_cycle_is_found_where_there_is_one(tmp_path: Path) -> None:
    """The check itself: a package whose two modules import each other (one of them inside a
    function) is reported, and the same package without the back edge is not."""
    package = tmp_path / "treadle" / "demo"
    package.mkdir(parents=True)
    (tmp_path / "treadle" / "__init__.py").write_text("")
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "a.py").write_text("from treadle.demo import b\n")
    (package / "b.py").write_text("def f():\n    from treadle.demo.a import x\n")
    (package / "c.py").write_text("from . import b\n")
    root = tmp_path / "treadle"
    assert import_cycles(import_graph(root)) == [["treadle.demo.a", "treadle.demo.b"]]
    (package / "b.py").write_text("x = 1\n")
    assert import_cycles(import_graph(root)) == []


# treadle/platform: the process's plumbing at the top, which imports no package; each package
# may import the plumbing and the packages named here (docs/design.md, "The map").
PLATFORM_PLUMBING = {
    "after_commit",
    "child_process",
    "config",
    "db",
    "embedded",
    "errors",
    "logs",
    "metrics",
}
PLATFORM_LAYERS = {
    "eventlog": set(),
    "models": {"eventlog", "tenancy"},  # the registry: its table, events and operator checks
    "tenancy": {"eventlog"},
    "sessions": {"eventlog", "tenancy", "models"},  # status: the models and their hosts
    "billing": {"eventlog", "tenancy", "sessions"},
    "checkpoints": {"eventlog", "tenancy", "sessions"},
    "operations": {"eventlog", "tenancy", "sessions", "billing"},
    "audit": {"eventlog", "tenancy", "sessions", "billing", "operations"},
    "serving": {"eventlog", "models", "tenancy", "sessions", "checkpoints", "operations"},
    # SageMaker's resources: named sessions over `operations`' commands, packages over
    # checkpoints, the Hub over the model registry.
    "sagemaker": {
        "eventlog",
        "models",
        "tenancy",
        "sessions",
        "checkpoints",
        "billing",
        "operations",
    },
}
API_SURFACES = {"tinker", "treadle", "openai", "anthropic", "sagemaker"}
# The shared modules of treadle/api that reach into the surfaces: the app factory registers
# their blueprints, the OpenAPI document describes their bodies.
API_ASSEMBLERS = {"treadle.api.app", "treadle.api.openapi"}


def _unit(module: str, package: str) -> str | None:
    """The first part of `module` below `package` (its subpackage, or a top module's name)."""
    prefix = package + "."
    return module[len(prefix) :].split(".")[0] if module.startswith(prefix) else None


def test_platform_is_plumbing_at_the_top_and_packages_below() -> None:
    top = {path.stem for path in (ROOT / "platform").glob("*.py")} - {"__init__"}
    packages = {path.parent.name for path in (ROOT / "platform").glob("*/__init__.py")}
    assert top == PLATFORM_PLUMBING
    assert packages == set(PLATFORM_LAYERS)


def test_platform_packages_import_only_the_layers_below_them() -> None:
    """Each package of treadle/platform imports the plumbing and the packages its row allows,
    so the packages form no cycle either; the plumbing imports no package."""
    violations = []
    for module, imported in sorted(import_graph().items()):
        mine = _unit(module, "treadle.platform")
        if mine is None:
            continue
        allowed = PLATFORM_LAYERS.get(mine, set()) | {mine} | PLATFORM_PLUMBING
        for name in sorted(imported):
            theirs = _unit(name, "treadle.platform")
            if theirs is not None and theirs not in allowed:
                violations.append(f"{module} imports {name}")
    assert violations == []


def test_api_surfaces_import_no_other_surface() -> None:
    """A surface of treadle/api imports the shared modules and the platform, never another
    surface; of the shared modules only the assemblers import a surface."""
    violations = []
    for module, imported in sorted(import_graph().items()):
        mine = _unit(module, "treadle.api")
        if mine is None:
            continue
        for name in sorted(imported):
            theirs = _unit(name, "treadle.api")
            if theirs in API_SURFACES and theirs != mine and module not in API_ASSEMBLERS:
                violations.append(f"{module} imports {name}")
    assert violations == []


# treadle/engine: what it may take from the platform (errors, config, the model catalogue, the
# LoRA target names, loss specs, tokenizers, validation limits), and its rooms in layers: each
# unit imports only those its row names (and itself). `treadle.engine` itself (its __init__) is
# the facade the worker imports and may import any room.
ENGINE_PLATFORM = {
    "treadle.platform.errors",
    "treadle.platform.config",
    "treadle.platform.child_process",  # vLLM's servers end with their worker
    "treadle.platform.models.catalog",
    "treadle.platform.models.lora_names",  # the LoRA target rules registration applies too
    "treadle.platform.models.structure",  # the layer types registration admits, the sampler's
    "treadle.platform.models.losses",
    "treadle.platform.models.custom_losses",  # the graph rules admission checks, re-checked
    "treadle.platform.models.tokenizers",
    "treadle.platform.models.validation",
}
_BELOW_PROTOCOL = {"models", "memory", "optim", "dimuon", "gradients", "lora", "losses", "sampling"}
ENGINE_LAYERS: dict[str, set[str]] = {
    "models": set(),
    "memory": set(),
    "optim": set(),
    "dimuon": {"optim"},  # the Dimuon optimizer, beside AdamW's `optim` (its grad clipping)
    "gradients": set(),  # the canonical sum of a request's gradient
    "lora": {"models", "memory", "optim", "dimuon"},
    "losses": {"models", "memory", "lora"},
    "sampling": {"models", "memory", "lora", "losses"},
    "protocol": {
        "gradients",
        "lora",
        "losses",
        "optim",
        "dimuon",
        "sampling",
    },  # interfaces, value types
    "footprint": {"models", "memory", "lora", "losses"},  # a base model's memory, for admission
    # a Parallelism: ranks, collectives, sharding (handing a loaded layer's pages back: memory)
    "distributed.vocabulary": {"models", "protocol"},  # embeddings and head split by rows
    "distributed.group": {"protocol", "gradients", "memory", "distributed.vocabulary"},
    "training": _BELOW_PROTOCOL | {"protocol"},  # spread by a Parallelism, never the group
    "engine": _BELOW_PROTOCOL | {"protocol", "training"},
    "distributed.decoding": {"sampling", "distributed.group"},
    "distributed.executor": _BELOW_PROTOCOL
    | {"protocol", "engine", "distributed.group", "distributed.decoding"},
}


def _engine_unit(module: str) -> str | None:
    """The row of ENGINE_LAYERS `module` belongs to (None: not in treadle.engine, or its
    facade); "distributed" alone (the subpackage's __init__) belongs to no row."""
    if not module.startswith("treadle.engine."):
        return None
    rest = module.removeprefix("treadle.engine.")
    for unit in sorted(ENGINE_LAYERS, key=len, reverse=True):
        if rest == unit or rest.startswith(unit + "."):
            return unit
    return rest


def engine_layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import inside treadle.engine that its layer table does not allow."""
    violations = []
    for module, imported in sorted(graph.items()):
        mine = _engine_unit(module)
        if mine is None:
            continue
        allowed = ENGINE_LAYERS.get(mine, set()) | {mine}
        for name in sorted(imported):
            theirs = _engine_unit(name)
            if name == "treadle.engine" or (theirs is not None and theirs not in allowed):
                violations.append(f"{module} imports {name}")
    return violations


def test_engine_rooms_are_the_layer_table() -> None:
    """Every module of treadle/engine sits in a row of ENGINE_LAYERS (or is the facade or a
    subpackage's __init__)."""
    rooms = {_engine_unit(m) for m in import_graph() if m.startswith("treadle.engine.")}
    assert rooms - {"distributed"} == set(ENGINE_LAYERS)


def test_engine_rooms_import_only_the_layers_below_them() -> None:
    assert engine_layer_violations(import_graph()) == []


def test_a_room_importing_above_its_layer_is_found() -> None:
    """The check itself: the LoRA room importing the training bodies, and any room importing
    the facade, are reported; the same imports reversed are not."""
    graph = {
        "treadle.engine.lora.adapters": {"treadle.engine.training"},
        "treadle.engine.models.loading": {"treadle.engine"},
        "treadle.engine.training": {"treadle.engine.lora.adapters"},
    }
    assert engine_layer_violations(graph) == [
        "treadle.engine.lora.adapters imports treadle.engine.training",
        "treadle.engine.models.loading imports treadle.engine",
    ]


def test_engine_takes_from_the_platform_only_what_it_needs() -> None:
    taken = {
        f"{module} imports {name}"
        for module, imported in import_graph().items()
        if module.startswith("treadle.engine")
        for name in imported
        if name.startswith("treadle.platform") and name not in ENGINE_PLATFORM
        and name != "treadle.platform.models"  # `from treadle.platform.models import x`
    }  # fmt: skip
    assert sorted(taken) == []


def test_the_worker_reaches_the_engine_only_through_its_facade() -> None:
    """treadle.worker imports `treadle.engine` (its __init__), never a room of it."""
    violations = [
        f"{module} imports {name}"
        for module, imported in sorted(import_graph().items())
        if module.startswith("treadle.worker")
        for name in sorted(imported)
        if name.startswith("treadle.engine.")
    ]
    assert violations == []


def test_only_the_engines_distributed_room_imports_torch_distributed() -> None:
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted(ROOT.rglob("*.py"))
        if not path.is_relative_to(ROOT / "engine" / "distributed")
        for name in _imports(path, with_names=True)
        if name == "torch.distributed" or name.startswith("torch.distributed.")
    ]
    assert violations == []


def test_the_worker_never_asks_which_engine_it_holds() -> None:
    """No isinstance or type() test against an engine class in treadle/worker: the single
    process's engine and a group's executor are both an `EngineAPI`."""
    classes = {"Engine", "GroupExecutor", "Group"}
    asked = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in {
                "isinstance", "type", "issubclass"
            }:  # fmt: skip
                named = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                if named & classes:
                    asked.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert asked == []


def _imports(path: Path, *, with_names: bool = False) -> set[str]:
    """The absolute imports of `path`; `with_names`: `from a import b` names `a.b` too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if with_names:
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_keeps_its_import_rules(package: str) -> None:
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in _imports(path)
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package])
    ]
    assert violations == []


def test_starting_the_api_loads_no_model_library() -> None:
    """The rules hold for what the API's imports import in turn: the API's process (`treadle up`,
    or a WSGI server's worker) starts without torch, transformers or the tinker SDK, whose
    package imports torch (tinker's protobuf schema is loaded from its file instead:
    treadle.api.tinker.proto). OpenAI-compatible serving loads transformers on its first
    request, for the model's chat template."""
    code = (
        "import sys, treadle.cli.main, treadle.api.app, treadle.api.gunicorn_conf; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'tinker') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _closure(dist: str, seen: set[str]) -> set[str]:
    key = re.sub(r"[-_.]+", "-", dist).lower()
    if key in seen:
        return seen
    seen.add(key)
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra, or another Python: not part of a plain `pip install treadle`
        _closure(req.name, seen)
    return seen


def test_installing_treadle_without_extras_pulls_in_no_server_dependency() -> None:
    closure = _closure("treadle", set())
    assert "tinker" in closure
    assert not closure & {"flask", "sqlalchemy", "celery", "kombu", "alembic", "psycopg"}


def test_only_the_entry_points_import_the_app_factory() -> None:
    """Views reach their services through `treadle.api.context`: no import cycle with app.py.
    The entry points are the CLI (`treadle up`) and the gunicorn entry (`treadle.api.wsgi`)."""
    importers = [
        str(path.relative_to(ROOT))
        for path in sorted(ROOT.rglob("*.py"))
        if "treadle.api.app" in _imports(path)
    ]
    assert importers == ["api/wsgi.py", "cli/serve.py"]


def test_the_server_takes_from_the_client_only_its_tool_call_format() -> None:
    """treadle.platform and treadle.api import nothing of treadle.client but `tool_calls` (how
    a model writes tools and calls, shared so serving renders and parses as training does),
    which loads neither the tinker SDK nor torch nor transformers."""
    taken = sorted(
        f"{module} imports {name}"
        for module, imported in import_graph().items()
        if module.startswith(("treadle.platform", "treadle.api"))
        for name in imported
        if name.startswith("treadle.client")
        and name not in {"treadle.client", "treadle.client.tool_calls"}
    )
    assert taken == []
    code = (
        "import sys, treadle.client.tool_calls; "
        "print(sorted(m for m in ('torch', 'transformers', 'tinker') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
