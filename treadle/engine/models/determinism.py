"""Deterministic CUDA: the process-wide settings under which what replay recomputes (a
forward_backward's passes, an optimizer step) gives the same bits every time on the same
hardware and software, so that recovery, replay and fork do not report a false divergence.

`apply(device)` is called where the engine picks its device (`Engine.__init__`), before it
creates any CUDA tensor. That is early enough for cuBLAS, which reads its workspace setting when
torch makes its first cuBLAS handle, at the first matmul: a worker builds its engine before it
runs anything, and a group rank's only CUDA work before it (`distributed.group.init_from_env`:
`set_device`, NCCL's process group) makes no cuBLAS handle. On CUDA it sets:
- CUBLAS_WORKSPACE_CONFIG=:4096:8 (unless the operator set it): cuBLAS picks reduction orders by
  its workspace, and reads the variable when its first handle is made, at the first matmul;
- `torch.use_deterministic_algorithms(True)`, strict: an operation with no deterministic kernel
  raises instead of running one (a failed call, never silently different weights);
- cuDNN deterministic, its autotuner off (`benchmark` picks kernels by timing);
- TF32 off (float32 matmuls and convolutions in IEEE precision), through torch's
  `fp32_precision` settings only: mixing them with the legacy `allow_tf32` flags is an error;
- scaled_dot_product_attention on the memory-efficient kernel, or the math one where it cannot
  run: both are deterministic forward and backward in strict mode (the efficient backward runs
  one key split), where the cuDNN backend is not (torch refuses it in strict mode) and flash
  cannot take the padding mask a batch of several sequences needs. Pinned here, the choice is a
  function of the inputs alone.
On the CPU nothing changes: its float32 kernels already repeat bit for bit at a fixed thread
count (`threads`), and strict mode would fill every new tensor (`fill_uninitialized_memory`).
`attention_implementation` is the transformers attention a model loads with: "sdpa" where its
class supports it, else "eager" (plain matmuls and softmax).
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedModel

__all__ = ["CUBLAS_WORKSPACE", "attention_implementation", "apply"]

CUBLAS_WORKSPACE = ":4096:8"  # eight 4 MiB buffers: torch's documented deterministic setting


def apply(device: torch.device) -> None:
    """Make what an engine on `device` recomputes deterministic (see the module's docstring).
    Idempotent; the settings are the process's, as torch's are."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # type: ignore[attr-defined]
    torch.backends.cudnn.rnn.fp32_precision = "ieee"  # type: ignore[attr-defined]
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    torch.backends.cuda.enable_math_sdp(True)


def attention_implementation(model_class: type[PreTrainedModel]) -> str:
    """The attention `model_class` loads with: torch's SDPA (pinned by `apply`) where the class
    supports it, else its eager attention."""
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
