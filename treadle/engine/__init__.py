"""Compute: LoRA training and sampling on shared base models, behind one declared interface.

Token ids in, one result or one error per request out; no SQL, Celery, Redis or HTTP. The
worker (`treadle.worker`) imports the engine only from here: `EngineAPI` (`protocol`), the
single-process `Engine`, a worker group's `GroupExecutor` and the value types its calls take
and return. The rooms: `models/` (loading, CPU kernels, threads), `lora/` (adapters, targets,
files, snapshots), `losses/` (losses, chunked logprobs), `sampling/` (sampling rules, the decode
loop, prompt scores), `memory/` (paging, heap, fingerprints, capacity), `distributed/` (the
group, its executor, group decoding); `optim`, `training` and `footprint` (a base model's memory
for admission) at the top.

The names load on first use (PEP 562), so that importing one room (the heap's tuning, say)
does not load every other room, torch.distributed and transformers with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.engine.dimuon import DimuonSpec
    from treadle.engine.distributed.executor import GroupExecutor, follow
    from treadle.engine.distributed.group import GROUP_FAILED_EXIT, Group, init_from_env, leave
    from treadle.engine.engine import Engine
    from treadle.engine.footprint import PassSettings, model_footprint
    from treadle.engine.lora.adapters import LoraSpec
    from treadle.engine.losses.functions import EngineDatum
    from treadle.engine.memory import heap
    from treadle.engine.memory.capacity import Capacity, device_memory
    from treadle.engine.optim import AdamSpec
    from treadle.engine.protocol import (
        ALONE,
        STATE_PARTS,
        EngineAPI,
        ForwardBackwardResult,
        Interrupt,
        Parallelism,
        SampleBatchAPI,
        Topology,
    )
    from treadle.engine.sampling.decode import Key, SampleRequest
    from treadle.engine.sampling.kv_pool import kv_need
    from treadle.engine.sampling.prompt_scores import PromptScoring, PromptTargets
    from treadle.engine.sampling.rules import SampledSequence, SampleResult, SamplingSpec
    from treadle.engine.sampling.vllm_server import VllmSettings

# Each public name -> the module that defines it (a module itself where the name is one).
_WHERE = {
    "ALONE": "treadle.engine.protocol",
    "AdamSpec": "treadle.engine.optim",
    "DimuonSpec": "treadle.engine.dimuon",
    "Capacity": "treadle.engine.memory.capacity",
    "Engine": "treadle.engine.engine",
    "EngineAPI": "treadle.engine.protocol",
    "EngineDatum": "treadle.engine.losses.functions",
    "ForwardBackwardResult": "treadle.engine.protocol",
    "GROUP_FAILED_EXIT": "treadle.engine.distributed.group",
    "Group": "treadle.engine.distributed.group",
    "GroupExecutor": "treadle.engine.distributed.executor",
    "Interrupt": "treadle.engine.protocol",
    "EngineImage": "treadle.engine.models.vision",
    "Key": "treadle.engine.sampling.decode",
    "LoraSpec": "treadle.engine.lora.adapters",
    "Parallelism": "treadle.engine.protocol",
    "PassSettings": "treadle.engine.footprint",
    "device_memory": "treadle.engine.memory.capacity",
    "model_footprint": "treadle.engine.footprint",
    "PromptScoring": "treadle.engine.sampling.prompt_scores",
    "PromptTargets": "treadle.engine.sampling.prompt_scores",
    "STATE_PARTS": "treadle.engine.protocol",
    "SampleBatchAPI": "treadle.engine.protocol",
    "SampleRequest": "treadle.engine.sampling.decode",
    "SampleResult": "treadle.engine.sampling.rules",
    "SampledSequence": "treadle.engine.sampling.rules",
    "SamplingSpec": "treadle.engine.sampling.rules",
    "Topology": "treadle.engine.protocol",
    "VllmSettings": "treadle.engine.sampling.vllm_server",
    "follow": "treadle.engine.distributed.executor",
    "heap": "treadle.engine.memory.heap",
    "init_from_env": "treadle.engine.distributed.group",
    "kv_need": "treadle.engine.sampling.kv_pool",
    "leave": "treadle.engine.distributed.group",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'treadle.engine' has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name])
    value = module if module.__name__.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


__all__ = [
    "ALONE",
    "Parallelism",
    "GROUP_FAILED_EXIT",
    "STATE_PARTS",
    "AdamSpec",
    "Capacity",
    "DimuonSpec",
    "Engine",
    "EngineAPI",
    "EngineDatum",
    "EngineImage",
    "ForwardBackwardResult",
    "Group",
    "GroupExecutor",
    "Interrupt",
    "Key",
    "LoraSpec",
    "PassSettings",
    "PromptScoring",
    "PromptTargets",
    "SampleBatchAPI",
    "SampleRequest",
    "SampleResult",
    "SampledSequence",
    "SamplingSpec",
    "Topology",
    "VllmSettings",
    "device_memory",
    "follow",
    "model_footprint",
    "heap",
    "init_from_env",
    "kv_need",
    "leave",
]
