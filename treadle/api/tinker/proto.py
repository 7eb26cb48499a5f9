"""The tinker protobuf schema (`tinker_public_pb2`, shipped with the pinned tinker SDK), loaded
from its file without importing the SDK.

`import tinker.proto...` runs the `tinker` package's `__init__` first, which imports the whole
SDK and, through its tensor types, torch: 2.2 of the API's 6.8 s of imports here, and torch's
memory in a process that never runs a model. The generated module needs only protobuf. Its
file is registered in protobuf's default pool under its own name, so the message classes are the
same ones the SDK's copy of the module gives, in whichever order the two are loaded.
Imports nothing of treadle, and never the `tinker` package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load"]

_NAME = "treadle.api._tinker_public_pb2"


def load() -> ModuleType:
    """The generated module (once per process)."""
    if (loaded := sys.modules.get(_NAME)) is not None:
        return loaded
    sdk = importlib.util.find_spec("tinker")  # a top-level name: finding it imports nothing
    if sdk is None or not sdk.submodule_search_locations:
        raise ImportError("the tinker package (a dependency of treadle) is not installed")
    path = Path(sdk.submodule_search_locations[0]) / "proto" / "tinker_public_pb2.py"
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load tinker's protobuf schema from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NAME]
        raise
    return module
