"""The in-process baseline of the training benchmarks, and the worker's memory as /proc shows it.

`Baseline` is plain transformers + peft in the benchmark's own process: one adapter of the same
rank and targets as a Treadle session's, float32 like Treadle's, AdamW with the same settings,
kept loaded for the whole run. The benchmarks time it between their Treadle measurements, so
the machine's drifting load falls on both alike.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import psutil
import torch

from treadle.engine.lora.targets import ATTN_SUFFIXES, MLP_SUFFIXES, UNEMBED_SUFFIXES
from treadle.engine.models.loading import load_base_model
from treadle.platform.config import DEFAULT_CACHE_DIR
from treadle.recipes.platform_process import LocalPlatform

LEARNING_RATE = 1e-4


def batch(size: int, length: int) -> list[list[int]]:
    """`size` sequences of `length` + 1 token ids (inputs and their shifted targets)."""
    return [[(131 * i + 17 * j) % 5000 + 100 for j in range(length + 1)] for i in range(size)]


class Baseline:
    """Plain transformers + peft in this process: one adapter of the same rank and targets,
    float32 like Treadle's, AdamW with the same settings, kept loaded for the whole run."""

    def __init__(self, model_name: str, seqs: list[list[int]], rank: int) -> None:
        from peft import LoraConfig, get_peft_model

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        model, _ = load_base_model(model_name, DEFAULT_CACHE_DIR, self.device, dtype)
        config = LoraConfig(
            r=rank,
            lora_alpha=32,
            target_modules=list(ATTN_SUFFIXES + MLP_SUFFIXES + UNEMBED_SUFFIXES),
            lora_dropout=0.0,
        )
        with warnings.catch_warnings():  # lm_head is tied to the embeddings; LoRA leaves both be
            warnings.simplefilter("ignore")
            self.model = get_peft_model(model, config)
        for p in self.model.parameters():  # the adapter in float32, as Treadle keeps it
            if p.requires_grad:
                p.data = p.data.float()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, betas=(0.9, 0.95),
                                           eps=1e-12, weight_decay=0.0)  # fmt: skip
        self.ids_B_T = torch.tensor([s[:-1] for s in seqs], device=self.device)
        self.targets_B_T = torch.tensor([s[1:] for s in seqs], device=self.device)
        self.step()  # warm-up

    def step(self) -> float:
        """Seconds of one forward + cross-entropy backward + AdamW step."""
        started = time.perf_counter()
        self._forward_backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        return time.perf_counter() - started

    def forward_backward(self) -> float:
        """Seconds of one forward + cross-entropy backward (the grads then dropped, untimed)."""
        started = time.perf_counter()
        self._forward_backward()
        self._sync()
        seconds = time.perf_counter() - started
        self.optimizer.zero_grad(set_to_none=True)
        return seconds

    def _forward_backward(self) -> None:
        logits_B_T_V = self.model(input_ids=self.ids_B_T).logits.float()
        logprobs_B_T = torch.log_softmax(logits_B_T_V, -1).gather(-1, self.targets_B_T[..., None])
        (-logprobs_B_T.sum()).backward()

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def worker_pid(platform: LocalPlatform) -> int:
    """The pid of the platform's one worker process (`treadle.cli worker`, a child of `up`)."""
    assert platform.proc is not None
    for child in psutil.Process(platform.proc.pid).children(recursive=True):
        cmdline = child.cmdline()
        if "treadle.cli" in cmdline and "worker" in cmdline:
            return int(child.pid)
    raise RuntimeError("no worker process found under `treadle up`")


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid`, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int) -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
