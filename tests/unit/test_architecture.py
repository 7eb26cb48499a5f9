"""The import rules of ARCHITECTURE.md, and the client's install footprint."""

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
        "treadle.gpu_worker",
    ),
    "platform": ("treadle.api", "treadle.gpu_worker", "flask", "torch"),
    "api": ("torch", "treadle.gpu_worker", "transformers", "peft"),
    "gpu_worker": ("treadle.api", "flask"),
    # Recipes are user code: the SDKs and their own modules. Only --embedded reaches for the
    # platform (treadle.platform.embedded.free_port, to start `treadle up`).
    "recipes": ("treadle.api", "treadle.gpu_worker", "flask", "sqlalchemy", "celery"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
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
    treadle.api.tinker_proto). OpenAI-compatible serving loads transformers on its first
    request, for the model's chat template."""
    code = (
        "import sys, treadle.cli, treadle.api.app, treadle.api.gunicorn_conf; "
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
    assert importers == ["api/wsgi.py", "cli.py"]
