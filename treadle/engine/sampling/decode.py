"""Sampling many requests in one batch: the decode loop every sample goes through.

Owns `SampleJob` (one validated request: prompt, count, `SamplingSpec`, prompt scoring, the
adapter weights to sample with) and `DecodeBatch`, a continuous batch within a KV budget: a job
reserves the most KV slots it can use (its prompt once, plus each sample's tokens but the last)
and joins at the next decoding step if they fit, else it waits, in order of arrival, until
enough leave; a job that needs more than the whole budget runs alone, once the others are done,
in a pool of its own size. Joining jobs'
prompts are prefilled together, each prompt's keys and values written once into the batch's
`kv_pool` and read by all of its samples; every step writes each row's new token into a slot of
the pool, in place, and decodes all rows in one forward pass, each row with its own job's
adapter (`LoraHost.use_rows` with `RowAdapters`). Rows are left-padded to a common length, with
an attention mask and explicit positions. Every job draws from its own seeded generator in the
same order as it would alone, so a job's tokens do not depend on its neighbours or on when it
joined. `generate_batch` runs a fixed set of jobs to the end. One result or one error per job.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from treadle.engine.lora.adapters import LoraHost, LoraWeights, RowAdapters
from treadle.engine.losses.functions import MICROBATCH_LOGITS
from treadle.engine.models import vision
from treadle.engine.models.vision import EngineImage
from treadle.engine.sampling.kv_pool import KvPool, Plan, PooledCache, kv_need
from treadle.engine.sampling.prompt_scores import (
    PromptScores,
    PromptScoring,
    score_prompt,
    topk_logprobs,
)
from treadle.engine.sampling.rows import Rows
from treadle.engine.sampling.rules import (
    ALT_SEED_OFFSET,
    EosIds,
    SampledSequence,
    SampleResult,
    SamplingSpec,
    cache_kwarg,
    choose,
    sampling_logits,
    stop_rules,
)
from treadle.platform.config import DEFAULT_SAMPLER_KV_TOKENS
from treadle.platform.errors import ValidationError
from treadle.platform.models.structure import CACHED_LAYER_TYPES

__all__ = ["DecodeBatch", "SampleJob", "SampleRequest", "generate_batch"]

# The attention layer types (transformers' `layer_types`) whose keys the pool can keep, every
# row's gathered into consecutive columns. A sliding-window layer's mask is built by the model
# from its config, per layer type, over those columns: as every row's tokens sit in consecutive
# columns (padding only on the left), a window over columns is the window over the row's own
# tokens, so a full cache gives exactly the tokens of the model without one. It keeps all keys
# of a sliding layer, not only the last window's: more memory than needed (and more attention
# work), the price of one slot layout for every layer.
# The one list, which registration also checks (`platform/models/structure.py`).
_LAYER_TYPES = CACHED_LAYER_TYPES


@dataclass(frozen=True)
class SampleRequest:
    """One request as the engine takes it: which weights (`snapshot_id` None: the base model
    alone), the prompt, what to sample and what to score. `interrupt`: see `SampleJob`."""

    base_model: str
    snapshot_id: str | None
    prompt: Sequence[int]
    num_samples: int
    params: SamplingSpec
    scoring: PromptScoring = field(default_factory=PromptScoring)
    topk_sample_logprobs: int = 0
    interrupt: Callable[[], None] | None = None
    images: tuple[EngineImage, ...] = ()  # a vision-language model's, at their tokens


@dataclass(frozen=True)
class SampleJob:
    """One request, validated (`sampler.validate_sampling`). `weights` None: the base model
    alone. `interrupt` is called before each decoding step: what it raises (an Exception)
    becomes this job's result and its rows leave the batch."""

    prompt: Sequence[int]
    num_samples: int
    params: SamplingSpec
    scoring: PromptScoring = field(default_factory=PromptScoring)
    topk_sample_logprobs: int = 0
    weights: LoraWeights | None = None
    interrupt: Callable[[], None] | None = None
    pixels: dict[str, np.ndarray] | None = None  # its images' (`vision.pixel_arrays`)


class _Decoding:
    """One job's progress: its generator, stop rules and what each of its rows has drawn."""

    def __init__(self, job: SampleJob, device: torch.device, eos_token_id: EosIds) -> None:
        self.job = job
        n = job.num_samples
        self.seed = job.params.seed if job.params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device=device).manual_seed(self.seed)
        self.stop_ids, self.stop_strings = stop_rules(job.params.stop, eos_token_id)
        self.tokens_N: list[list[int]] = [[] for _ in range(n)]
        self.logprobs_N: list[list[float]] = [[] for _ in range(n)]
        self.topk_N: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.steps = 0
        self.done = job.params.max_tokens == 0
        self.error: Exception | None = None
        self.scores = PromptScores()
        self.slots: list[int] = []  # the pool slots of its tokens (its prompt's, then its rows')

    def step(self, logits_N_V: torch.Tensor, decode: Callable[[list[int]], str]) -> torch.Tensor:
        """Draw each row's next token (as `sampler` alone would); returns them, [N]."""
        params, k = self.job.params, self.job.topk_sample_logprobs
        chosen_N, lp_N = choose(logits_N_V, params, self.generator)
        topk_rows = topk_logprobs(sampling_logits(logits_N_V, params), k) if k else None
        for row, (token, lp) in enumerate(zip(chosen_N.tolist(), lp_N.tolist(), strict=True)):
            if self.reasons[row] is not None:
                continue
            self.tokens_N[row].append(token)
            self.logprobs_N[row].append(lp)
            if topk_rows is not None:
                self.topk_N[row].append(topk_rows[row])
            if token in self.stop_ids or (
                self.stop_strings
                and any(s in decode(self.tokens_N[row]) for s in self.stop_strings)
            ):
                self.reasons[row] = "stop"
        self.steps += 1
        if all(r is not None for r in self.reasons) or self.steps == params.max_tokens:
            self.done = True
        return chosen_N

    def result(self) -> SampleResult | Exception:
        if self.error is not None:
            return self.error
        k = self.job.topk_sample_logprobs
        sequences = [
            SampledSequence(
                tokens=t, logprobs=lp, stop_reason=r or "length", topk_logprobs=topk if k else None
            )
            for t, lp, r, topk in zip(
                self.tokens_N, self.logprobs_N, self.reasons, self.topk_N, strict=True
            )
        ]
        s = self.scores
        return SampleResult(
            sequences=sequences,
            prompt_logprobs=s.prompt_logprobs,
            prefill_tokens=len(self.job.prompt),
            sample_tokens=sum(len(t) for t in self.tokens_N),
            topk_prompt_logprobs=s.topk_prompt_logprobs,
            target_prompt_logprobs=s.target_logprobs,
            prompt_alt_tokens=s.alt_tokens,
            prompt_alt_logprobs=s.alt_logprobs,
        )


Key = Hashable  # how the caller names a job in a `DecodeBatch`
Finished = list[tuple[Key, SampleResult | Exception]]


class DecodeBatch:
    """A running batch that jobs join (`add`; they decode from the next step once their KV
    fits in the budget, `kv_tokens` slots per layer) and leave (when done, in what `step`
    returns). Each live row holds the logits of its next token; rows read their tokens' KV from
    the pool (`kv_pool`), left-padded to a common length, with an attention mask and explicit
    positions.

    Not thread-safe: the caller serialises `add` and `step`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        host: LoraHost,
        *,
        eos_token_id: EosIds,
        decode: Callable[[list[int]], str],
        kv_tokens: int = DEFAULT_SAMPLER_KV_TOKENS,
    ) -> None:
        self._model = model
        self._host = host
        self._eos_token_id = eos_token_id
        self._decode = decode
        self._device = next(model.parameters()).device
        self._kwarg = cache_kwarg(model)
        # a vision-language model's rows carry multimodal rotary positions (`Rows.rope_R`)
        self._multimodal = getattr(model.config, "vision_config", None) is not None
        _check_layer_types(model.config)
        layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
        self.kv = KvPool(kv_tokens, layers)
        self._cache = PooledCache(self.kv)
        self._waiting: dict[Key, SampleJob] = {}  # in order of arrival, until their KV fits
        self._states: dict[Key, _Decoding] = {}
        self._owner_R: list[Key] = []  # each row's job
        self._rows: Rows | None = None
        self.steps = 0  # decoding steps run

    def __len__(self) -> int:
        """Jobs decoding or waiting to."""
        return len(self._states) + len(self._waiting)

    def __contains__(self, key: Key) -> bool:
        return key in self._states or key in self._waiting

    @property
    def rows(self) -> int:
        """Rows decoding (each job's samples), what the next step's forward pass computes."""
        return len(self._owner_R)

    @property
    def waiting(self) -> list[Key]:
        """The jobs waiting for room in the KV budget, first come first."""
        return list(self._waiting)

    @property
    def waiting_prompt_tokens(self) -> int:
        return sum(len(job.prompt) for job in self._waiting.values())

    def drawn(self, key: Key) -> tuple[list[list[int]], list[list[float]]]:
        """What job `key` (decoding or waiting) has drawn so far: each sample's tokens and their
        logprobs (live lists: copy what must not change at the next step)."""
        if key in self._waiting:
            n = self._waiting[key].num_samples
            return [[] for _ in range(n)], [[] for _ in range(n)]
        state = self._states[key]
        return state.tokens_N, state.logprobs_N

    def add(self, jobs: Sequence[tuple[Key, SampleJob]]) -> Finished:
        """Queue `jobs`; those whose KV fits in the budget (in order of arrival, behind any
        already waiting) are prefilled now (their prompts scored) and decode from the next step
        (one larger than the whole budget: alone, once nothing else holds any). Returns those
        already finished (nothing to sample)."""
        for key, job in jobs:
            if key not in self:
                self._waiting[key] = job
        return self._admit()

    def step(self, interrupt: Callable[[], None] | None = None) -> Finished:
        """Let the waiting jobs that now fit join, then one token for every live row (each job
        drawing from its own generator), then one forward pass over the rows still decoding;
        returns the jobs that finished. What `interrupt` raises ends the call with the batch
        unchanged; what a job's own `interrupt` raises becomes that job's result (a waiting
        job's too)."""
        if interrupt is not None:
            interrupt()
        finished = self._interrupt_waiting()
        finished += self._admit()
        rows = self._rows
        if rows is None or not self._owner_R:
            return finished
        self.steps += 1
        with torch.inference_mode():
            chosen_R = torch.empty(len(self._owner_R), dtype=torch.long, device=self._device)
            for key, span in _spans(self._owner_R):
                state = self._states[key]
                try:
                    if state.job.interrupt is not None:
                        state.job.interrupt()
                except Exception as exc:  # this job only: its neighbours go on
                    state.error, state.done = exc, True
                    continue
                chosen_R[span] = state.step(rows.logits_R_V[span], self._decode)
            done = [key for key, s in self._states.items() if s.done]
            live = [i for i, key in enumerate(self._owner_R) if not self._states[key].done]
            if len(live) < len(self._owner_R):
                keep_R = torch.tensor(live, dtype=torch.long, device=self._device)
                rows = rows.selected(keep_R)
                chosen_R = chosen_R[keep_R]
                self._owner_R = [self._owner_R[i] for i in live]
            for key in done:
                self._leave(self._states[key])
            if self._owner_R:
                rows = self._forward(rows, chosen_R)
            self._rows = rows if self._owner_R else None
        return finished + [(key, self._states.pop(key).result()) for key in done]

    def _interrupt_waiting(self) -> Finished:
        """The waiting jobs whose own `interrupt` raises, ended with what it raised."""
        finished: Finished = []
        for key, job in list(self._waiting.items()):
            try:
                if job.interrupt is not None:
                    job.interrupt()
            except Exception as exc:
                del self._waiting[key]
                finished.append((key, exc))
        return finished

    def _admit(self) -> Finished:
        """Prefill the waiting jobs that fit in the budget, first come first (one that does
        not fit holds back those behind it, so that a large job is not starved by small ones);
        returns those finished at once."""
        jobs: list[tuple[Key, SampleJob]] = []
        for key, job in self._waiting.items():
            need = _kv_need(job)
            if need > self.kv.budget and not self.kv.reserved:  # alone, in a pool of its size
                self.kv.resize(need)
            if not self.kv.fits(need):
                break
            self.kv.reserve(need)
            jobs.append((key, job))
        if not jobs:
            return []
        for key, _ in jobs:
            del self._waiting[key]
        states = {key: _Decoding(job, self._device, self._eos_token_id) for key, job in jobs}
        with torch.inference_mode():
            for group in self._prefill_groups(jobs):
                rows = self._prefill([job for _, job in group], [states[key] for key, _ in group])
                owner_R = [key for key, job in group for _ in range(job.num_samples)]
                owner_R, rows = self._without_done(states, owner_R, rows)
                if self._rows is None or not self._owner_R:
                    self._rows = rows
                    self._owner_R = owner_R
                elif owner_R:
                    self._rows = self._rows.merged(rows, self.kv.pad)
                    self._owner_R = self._owner_R + owner_R
        for state in states.values():
            if state.done:
                self._leave(state)
        self._states.update({key: s for key, s in states.items() if not s.done})
        return [(key, s.result()) for key, s in states.items() if s.done]

    def _leave(self, state: _Decoding) -> None:
        """A finished job's slots and reservation go back to the pool."""
        self.kv.give(state.slots)
        self.kv.release(_kv_need(state.job))
        state.slots = []
        if not self.kv.reserved and self.kv.tokens != self.kv.budget:
            self.kv.resize(self.kv.budget)  # a job larger than the budget ran alone: it is over

    def _prefill_groups(
        self, jobs: list[tuple[Key, SampleJob]]
    ) -> list[list[tuple[Key, SampleJob]]]:
        """`jobs` in consecutive groups, each prefilled in one pass, whose logits (jobs x the
        positions the group keeps x vocabulary) stay within `MICROBATCH_LOGITS`: prompts scored
        whole keep every position, so one pass over many long ones would hold gigabytes."""
        vocab = int(self._model.config.vocab_size)
        groups: list[list[tuple[Key, SampleJob]]] = []
        for key, job in jobs:
            if groups and _prefill_logits([*groups[-1], (key, job)]) * vocab <= MICROBATCH_LOGITS:
                groups[-1].append((key, job))
            else:
                groups.append([(key, job)])
        return groups

    def _prefill(self, jobs: list[SampleJob], states: list[_Decoding]) -> Rows:
        """The jobs' prompts in one left-padded forward pass, their keys and values written
        into the pool once per prompt: their prompt scores, and one row per sample holding the
        logits of its first token and reading its prompt's slots."""
        lengths_J = [len(job.prompt) for job in jobs]
        width = max(lengths_J)
        ids_J_L = torch.zeros(len(jobs), width, dtype=torch.long, device=self._device)
        mask_J_L = torch.zeros(len(jobs), width, dtype=torch.long, device=self._device)
        read_J_L = torch.full((len(jobs), width), self.kv.pad, dtype=torch.long)
        src: list[int] = []
        for j, (job, state) in enumerate(zip(jobs, states, strict=True)):
            # left padding: every prompt ends at the last column
            ids_J_L[j, width - lengths_J[j] :] = torch.tensor(list(job.prompt), device=self._device)
            mask_J_L[j, width - lengths_J[j] :] = 1
            state.slots = self.kv.take(lengths_J[j])
            read_J_L[j, width - lengths_J[j] :] = torch.tensor(state.slots)
            src += range(j * width + width - lengths_J[j], (j + 1) * width)
        read_J_L = read_J_L.to(self._device)
        dst = torch.tensor([s for state in states for s in state.slots], device=self._device)
        self.kv.plan = Plan(past=0, dst=dst, src=torch.tensor(src, device=self._device))
        positions_J_L = (mask_J_L.cumsum(-1) - 1).clamp(min=0)
        # a vision-language model's images, their explicit multimodal positions, and each
        # prompt's offset of the positions its samples continue at (0 without images)
        images, rope_J = vision.prompt_inputs(
            self._model, ids_J_L, mask_J_L, [job.pixels or {} for job in jobs]
        )
        positions = images.pop("position_ids", positions_J_L)
        keeps_J = [job.scoring.logits_to_keep(n) for job, n in zip(jobs, lengths_J, strict=True)]
        keep = 0 if 0 in keeps_J else max(keeps_J)
        prefill_adapters = RowAdapters([job.weights for job in jobs], self._device)
        with self._host.use_rows(prefill_adapters):
            out = self._model(
                input_ids=ids_J_L,
                attention_mask=mask_J_L,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=keep,
                **images,
                **{self._kwarg: self._cache},
            )
        for j, (job, state) in enumerate(zip(jobs, states, strict=True)):
            # the job's own last positions: what it would keep alone (all of its prompt if 0)
            logits_K_V = out.logits[j, -(keeps_J[j] or lengths_J[j]) :].float()
            alt = (state.seed + ALT_SEED_OFFSET) % 2**64
            state.scores = score_prompt(
                logits_K_V,
                job.prompt,
                job.scoring,
                temperature=job.params.temperature,
                generator=torch.Generator(device=self._device).manual_seed(alt),
            )
        owner_R = [j for j, job in enumerate(jobs) for _ in range(job.num_samples)]
        rows_R = torch.tensor(owner_R, dtype=torch.long, device=self._device)
        return Rows(
            logits_R_V=out.logits[owner_R, -1].float(),
            mask_R_L=mask_J_L[rows_R],
            read_R_L=read_J_L[rows_R],
            next_R=torch.tensor([lengths_J[j] for j in owner_R], device=self._device),
            adapters=RowAdapters(
                [jobs[j].weights for j in owner_R], self._device, prefill_adapters
            ),
            rope_R=rope_J[rows_R] if self._multimodal else None,
        )

    def _forward(self, rows: Rows, chosen_R: torch.Tensor) -> Rows:
        """Each row's token `chosen_R` written into a new slot of the pool, and the logits of
        the token after it."""
        new = self.kv.take(len(chosen_R))
        for key, span in _spans(self._owner_R):
            self._states[key].slots += new[span]
        new_R = torch.tensor(new, dtype=torch.long, device=self._device)
        mask_R_L = torch.cat([rows.mask_R_L, rows.mask_R_L.new_ones(len(chosen_R), 1)], dim=1)
        read_R_L = torch.cat([rows.read_R_L, new_R[:, None]], dim=1)
        self.kv.plan = Plan(past=read_R_L.shape[1] - 1, dst=new_R, read_R_L=read_R_L)
        positions = rows.next_R[:, None]
        if rows.rope_R is not None:  # the text position, then the 3 multimodal ones
            shifted = (rows.next_R + rows.rope_R)[None, :, None].expand(3, -1, -1)
            positions = torch.cat([positions[None], shifted])
        with self._host.use_rows(rows.adapters):
            out = self._model(
                input_ids=chosen_R[:, None],
                attention_mask=mask_R_L,
                position_ids=positions,
                use_cache=True,
                **{self._kwarg: self._cache},
            )
        return dataclasses.replace(
            rows,
            logits_R_V=out.logits[:, -1].float(),
            mask_R_L=mask_R_L,
            read_R_L=read_R_L,
            next_R=rows.next_R + 1,
        )

    def _without_done(
        self, states: dict[Key, _Decoding], owner_R: list[Key], rows: Rows
    ) -> tuple[list[Key], Rows]:
        """Drop the rows of jobs that sample nothing (max_tokens 0)."""
        live = [i for i, key in enumerate(owner_R) if not states[key].done]
        if len(live) == len(owner_R):
            return owner_R, rows
        keep_R = torch.tensor(live, dtype=torch.long, device=self._device)
        return [owner_R[i] for i in live], rows.selected(keep_R)


def _kv_need(job: SampleJob) -> int:
    return kv_need(len(job.prompt), job.num_samples, job.params.max_tokens)


def _prefill_logits(jobs: Sequence[tuple[Key, SampleJob]]) -> int:
    """Rows x positions of the logits that one prefill of `jobs` keeps (see `_prefill`)."""
    keeps_J = [job.scoring.logits_to_keep(len(job.prompt)) for _, job in jobs]
    kept = max(len(job.prompt) for _, job in jobs) if 0 in keeps_J else max(keeps_J)
    return len(jobs) * kept


def _check_layer_types(config: PreTrainedConfig) -> None:
    """ValidationError unless every attention layer of a model with `config` is one the pool
    can serve (`_LAYER_TYPES`)."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    other = sorted(set(layer_types) - _LAYER_TYPES)
    if other:
        raise ValidationError(
            f"this base model has {', '.join(other)} layers; batched sampling supports only "
            f"{' and '.join(sorted(_LAYER_TYPES))} layers, so sample a base model whose layers "
            "are all of those types"
        )


def generate_batch(
    model: PreTrainedModel,
    host: LoraHost,
    jobs: Sequence[SampleJob],
    *,
    eos_token_id: EosIds,
    decode: Callable[[list[int]], str],
    interrupt: Callable[[], None] | None = None,
) -> list[SampleResult | Exception]:
    """Every job's continuations (see `sampler` for what each field means), decoded together
    from the start. `interrupt` is called before each decoding step; what it raises ends the
    whole call.

    Per-token logprobs are under softmax(logits / temperature) before top-k/top-p truncation
    (under softmax(logits) when greedy); prompt logprobs under softmax(logits)."""
    batch = DecodeBatch(model, host, eos_token_id=eos_token_id, decode=decode)
    results: dict[Key, SampleResult | Exception] = dict(batch.add(list(enumerate(jobs))))
    while len(batch):
        results.update(batch.step(interrupt))
    return [results[j] for j in range(len(jobs))]


def _spans(owner_R: list[Key]) -> list[tuple[Key, slice]]:
    """(job, its rows) for each run of equal owners (a job's rows are contiguous)."""
    spans: list[tuple[Key, slice]] = []
    start = 0
    for i in range(1, len(owner_R) + 1):
        if i == len(owner_R) or owner_R[i] != owner_R[start]:
            spans.append((owner_R[start], slice(start, i)))
            start = i
    return spans
