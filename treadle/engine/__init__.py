"""Compute: LoRA training and sampling on shared base models, behind one declared interface.

Token ids in, one result or one error per request out; no SQL, Celery, Redis or HTTP. The
worker (`treadle.worker`) imports the engine only from here: `EngineAPI` (`protocol`), the
single-process `Engine`, a worker group's `GroupExecutor` and the value types its calls take
and return. The rooms: `models/` (loading, CPU kernels, threads), `lora/` (adapters, targets,
files, snapshots), `losses/` (losses, chunked logprobs), `sampling/` (sampling rules, the decode
loop, prompt scores), `memory/` (paging, heap, fingerprints, capacity), `distributed/` (the
group, its executor, group decoding); `optim` and `training` at the top.
"""

from treadle.engine.distributed.executor import GroupExecutor, follow
from treadle.engine.distributed.group import GROUP_FAILED_EXIT, Group, init_from_env, leave
from treadle.engine.engine import Engine
from treadle.engine.lora.adapters import LoraSpec
from treadle.engine.losses.functions import EngineDatum
from treadle.engine.memory import heap
from treadle.engine.memory.capacity import Capacity
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
from treadle.engine.sampling.prompt_scores import PromptScoring, PromptTargets
from treadle.engine.sampling.rules import SampledSequence, SampleResult, SamplingSpec

__all__ = [
    "ALONE",
    "Parallelism",
    "GROUP_FAILED_EXIT",
    "STATE_PARTS",
    "AdamSpec",
    "Capacity",
    "Engine",
    "EngineAPI",
    "EngineDatum",
    "ForwardBackwardResult",
    "Group",
    "GroupExecutor",
    "Interrupt",
    "Key",
    "LoraSpec",
    "PromptScoring",
    "PromptTargets",
    "SampleBatchAPI",
    "SampleRequest",
    "SampleResult",
    "SampledSequence",
    "SamplingSpec",
    "Topology",
    "follow",
    "heap",
    "init_from_env",
    "leave",
]
