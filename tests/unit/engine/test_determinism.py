"""Deterministic CUDA (engine/models/determinism.py), as far as the CPU can show it: an engine
built for CUDA sets every setting before CUDA initialises (each case in a fresh process: the
settings are the process's), a CPU engine changes none, and models load with the pinned
attention. The GPU run itself (the same steps twice, the same state hashes) is
benchmarks/engine_cuda_check.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import GptOssForCausalLM, LlamaForCausalLM

from tests import tiny_models
from treadle.engine.models import determinism
from treadle.engine.models.loading import load_base_model
from treadle.platform.models import model_files

_PROBE = """
import json, os, sys, tempfile
from pathlib import Path
import torch
before = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
from treadle.engine import Engine
Engine(cache_dir=Path(tempfile.mkdtemp()), device=sys.argv[1])
b = torch.backends
print(json.dumps({
    "before": before,
    "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    "cuda_initialised": torch.cuda.is_initialized(),
    "deterministic": torch.are_deterministic_algorithms_enabled(),
    "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    "cudnn_deterministic": b.cudnn.deterministic,
    "cudnn_benchmark": b.cudnn.benchmark,
    "matmul": b.cuda.matmul.fp32_precision,
    "conv": b.cudnn.conv.fp32_precision,
    "rnn": b.cudnn.rnn.fp32_precision,
    "sdpa": [b.cuda.flash_sdp_enabled(), b.cuda.cudnn_sdp_enabled(),
             b.cuda.mem_efficient_sdp_enabled(), b.cuda.math_sdp_enabled()],
}))
"""


def _settings_after_an_engine_on(device: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, device],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_an_engine_on_cuda_makes_the_process_deterministic_before_cuda_starts() -> None:
    s = _settings_after_an_engine_on("cuda")
    assert s["before"] is None
    assert s["cublas"] == determinism.CUBLAS_WORKSPACE == ":4096:8"
    assert s["cuda_initialised"] is False  # set before cuBLAS could have read it
    assert s["deterministic"] is True and s["warn_only"] is False
    assert s["cudnn_deterministic"] is True and s["cudnn_benchmark"] is False
    assert (s["matmul"], s["conv"], s["rnn"]) == ("ieee", "ieee", "ieee")  # no TF32
    assert s["sdpa"] == [False, False, True, True]  # flash and cuDNN off; efficient, math on


def test_an_engine_on_the_cpu_changes_no_setting() -> None:
    s = _settings_after_an_engine_on("cpu")
    assert s["cublas"] is None
    assert s["deterministic"] is False
    assert s["cudnn_benchmark"] is False and s["cudnn_deterministic"] is False
    assert s["sdpa"] == [True, True, True, True]


def test_models_load_with_the_pinned_attention(cache_dir: Path, tmp_path: Path) -> None:
    assert determinism.attention_implementation(LlamaForCausalLM) == "sdpa"
    assert determinism.attention_implementation(GptOssForCausalLM) == "eager"  # no SDPA there
    tiny, _ = load_base_model("treadle/tiny-debug", cache_dir, "cpu", torch.float32)
    assert tiny.config._attn_implementation == "sdpa"
    for arch, expected in (("llama3", "sdpa"), ("gpt-oss", "eager")):
        folder = tiny_models.model_folder(arch, tmp_path / arch)
        info = model_files.inspect_folder(f"tiny/{arch}", folder, model_files.Options())
        model, _ = load_base_model(info, cache_dir, "cpu", torch.float32)
        assert model.config._attn_implementation == expected, arch
