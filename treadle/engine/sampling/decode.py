"""Sampling many requests in one batch: the decode loop every sample goes through.

Owns `SampleJob` (one validated request: prompt, count, `SamplingSpec`, prompt scoring, the
adapter weights to sample with) and `DecodeBatch`, a continuous batch: jobs join between decoding
steps (their prompts prefilled together, left-padded, with an attention mask and positions, each
KV cache row expanded to `num_samples` rows and merged into the running cache) and leave as soon
as they finish. Every step decodes all rows in one forward pass, each row with its own job's
adapter (`LoraHost.use_rows` with `RowAdapters`). Every job draws from its own seeded generator in
the same order as it would alone, so a job's tokens do not depend on its neighbours or on when it
joined. Every layer's cache grows (sliding-window layers too: see `_LAYER_TYPES`).
`generate_batch` runs a fixed set of jobs to the end. One result or one error per job. Must not
import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from treadle.engine.lora.adapters import LoraHost, LoraWeights, RowAdapters
from treadle.engine.losses.functions import MICROBATCH_LOGITS
from treadle.engine.sampling.prompt_scores import (
    PromptScores,
    PromptScoring,
    score_prompt,
    topk_logprobs,
)
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
from treadle.platform.errors import ValidationError
from treadle.platform.models.structure import CACHED_LAYER_TYPES

__all__ = ["DecodeBatch", "SampleJob", "SampleRequest", "generate_batch"]

# The attention layer types (transformers' `layer_types`) whose cache can be a plain growing
# `DynamicLayer`, cropped and merged column by column. A sliding-window layer's mask is built by
# the model from its config, per layer type, over cache columns: as every row's tokens sit in
# consecutive columns (padding only on the left), a window over columns is the window over the
# row's own tokens, so a full cache gives exactly the tokens of the model without one. It keeps
# all keys of a sliding layer, not only the last window's: more memory than needed (and more
# attention work), the price of one column layout for every layer. transformers'
# `DynamicSlidingWindowLayer` drops old columns and counts the ones it has seen, which cropping
# and merging rows (`_Rows`) would have to keep consistent with the attention mask.
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
    """A running batch that jobs join (`add`, between steps) and leave (when done, in what
    `step` returns). Each live row holds the logits of its next token; the KV cache has one row
    per sample, left-padded to a common length, with an attention mask and explicit positions.

    Not thread-safe: the caller serialises `add` and `step`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        host: LoraHost,
        *,
        eos_token_id: EosIds,
        decode: Callable[[list[int]], str],
    ) -> None:
        self._model = model
        self._host = host
        self._eos_token_id = eos_token_id
        self._decode = decode
        self._device = next(model.parameters()).device
        self._kwarg = cache_kwarg(model)
        _check_layer_types(model.config)
        self._states: dict[Key, _Decoding] = {}
        self._owner_R: list[Key] = []  # each cache row's job
        self._rows: _Rows | None = None

    def __len__(self) -> int:
        """Jobs still decoding."""
        return len(self._states)

    def __contains__(self, key: Key) -> bool:
        return key in self._states

    @property
    def rows(self) -> int:
        """Rows decoding (each job's samples), what the next step's forward pass computes."""
        return len(self._owner_R)

    def drawn(self, key: Key) -> tuple[list[list[int]], list[list[float]]]:
        """What job `key` (still decoding) has drawn so far: each sample's tokens and their
        logprobs (live lists: copy what must not change at the next step)."""
        state = self._states[key]
        return state.tokens_N, state.logprobs_N

    def add(self, jobs: Sequence[tuple[Key, SampleJob]]) -> Finished:
        """Prefill `jobs` together (scoring their prompts) and let their rows join the batch;
        returns those already finished (nothing to sample)."""
        jobs = [(key, job) for key, job in jobs if key not in self._states]
        if not jobs:
            return []
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
                    self._rows = self._rows.merged(rows)
                    self._owner_R = self._owner_R + owner_R
        self._states.update({key: s for key, s in states.items() if not s.done})
        return [(key, s.result()) for key, s in states.items() if s.done]

    def step(self, interrupt: Callable[[], None] | None = None) -> Finished:
        """One token for every live row (each job drawing from its own generator), then one
        forward pass over the rows still decoding; returns the jobs that finished. What
        `interrupt` raises ends the call with the batch unchanged; what a job's own `interrupt`
        raises becomes that job's result."""
        if interrupt is not None:
            interrupt()
        rows = self._rows
        if rows is None or not self._owner_R:
            return []
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
            finished = [key for key, s in self._states.items() if s.done]
            live = [i for i, key in enumerate(self._owner_R) if not self._states[key].done]
            if len(live) < len(self._owner_R):
                keep_R = torch.tensor(live, dtype=torch.long, device=self._device)
                rows = rows.selected(keep_R)
                chosen_R = chosen_R[keep_R]
                self._owner_R = [self._owner_R[i] for i in live]
            if self._owner_R:
                rows = self._forward(rows, chosen_R)
            self._rows = rows if self._owner_R else None
        return [(key, self._states.pop(key).result()) for key in finished]

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

    def _prefill(self, jobs: list[SampleJob], states: list[_Decoding]) -> _Rows:
        """The jobs' prompts in one left-padded forward pass: their prompt scores, and one row
        per sample holding the logits of its first token."""
        lengths_J = [len(job.prompt) for job in jobs]
        width = max(lengths_J)
        ids_J_L = torch.zeros(len(jobs), width, dtype=torch.long, device=self._device)
        mask_J_L = torch.zeros(len(jobs), width, dtype=torch.long, device=self._device)
        for j, job in enumerate(jobs):  # left padding: every prompt ends at the last column
            ids_J_L[j, width - lengths_J[j] :] = torch.tensor(list(job.prompt), device=self._device)
            mask_J_L[j, width - lengths_J[j] :] = 1
        positions_J_L = (mask_J_L.cumsum(-1) - 1).clamp(min=0)
        keeps_J = [job.scoring.logits_to_keep(n) for job, n in zip(jobs, lengths_J, strict=True)]
        keep = 0 if 0 in keeps_J else max(keeps_J)
        cache = DynamicCache()  # no config: a growing DynamicLayer for every layer (see above)
        prefill_adapters = RowAdapters([job.weights for job in jobs], self._device)
        with self._host.use_rows(prefill_adapters):
            out = self._model(
                input_ids=ids_J_L,
                attention_mask=mask_J_L,
                position_ids=positions_J_L,
                use_cache=True,
                logits_to_keep=keep,
                **{self._kwarg: cache},
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
        cache.batch_select_indices(rows_R)
        return _Rows(
            cache=cache,
            logits_R_V=out.logits[owner_R, -1].float(),
            mask_R_L=mask_J_L[rows_R],
            next_R=torch.tensor([lengths_J[j] for j in owner_R], device=self._device),
            adapters=RowAdapters(
                [jobs[j].weights for j in owner_R], self._device, prefill_adapters
            ),
        )

    def _forward(self, rows: _Rows, chosen_R: torch.Tensor) -> _Rows:
        mask_R_L = torch.cat([rows.mask_R_L, rows.mask_R_L.new_ones(len(chosen_R), 1)], dim=1)
        with self._host.use_rows(rows.adapters):
            out = self._model(
                input_ids=chosen_R[:, None],
                attention_mask=mask_R_L,
                position_ids=rows.next_R[:, None],
                use_cache=True,
                **{self._kwarg: rows.cache},
            )
        return dataclasses.replace(
            rows, logits_R_V=out.logits[:, -1].float(), mask_R_L=mask_R_L, next_R=rows.next_R + 1
        )

    def _without_done(
        self, states: dict[Key, _Decoding], owner_R: list[Key], rows: _Rows
    ) -> tuple[list[Key], _Rows]:
        """Drop the rows of jobs that sample nothing (max_tokens 0)."""
        live = [i for i, key in enumerate(owner_R) if not states[key].done]
        if len(live) == len(owner_R):
            return owner_R, rows
        keep_R = torch.tensor(live, dtype=torch.long, device=self._device)
        return [owner_R[i] for i in live], rows.selected(keep_R)


@dataclass
class _Rows:
    """The decoding rows: KV cache [R, ..., L, ...], the logits of each row's next token, the
    attention mask [R, L] (0 on left padding), each row's next position and adapter."""

    cache: DynamicCache
    logits_R_V: torch.Tensor
    mask_R_L: torch.Tensor
    next_R: torch.Tensor
    adapters: RowAdapters

    def selected(self, keep_R: torch.Tensor) -> _Rows:
        """Only the rows `keep_R`, with the columns that are padding in all of them cropped."""
        self.cache.batch_select_indices(keep_R)
        mask_R_L = self.mask_R_L[keep_R]
        lead = int((mask_R_L.sum(dim=0) == 0).long().cumprod(dim=0).sum().item())
        if lead:
            mask_R_L = mask_R_L[:, lead:]
            for layer in _kv_layers(self.cache):
                layer.keys = layer.keys[..., lead:, :]
                layer.values = layer.values[..., lead:, :]
        return _Rows(
            cache=self.cache,
            logits_R_V=self.logits_R_V[keep_R],
            mask_R_L=mask_R_L,
            next_R=self.next_R[keep_R],
            adapters=self.adapters.selected(keep_R.tolist()),
        )

    def merged(self, other: _Rows) -> _Rows:
        """These rows and then `other`'s, both left-padded to the longer of the two."""
        width = max(self.mask_R_L.shape[1], other.mask_R_L.shape[1])
        for mine, theirs in zip(_kv_layers(self.cache), _kv_layers(other.cache), strict=True):
            mine.keys = torch.cat(
                [_pad_left(mine.keys, width, -2), _pad_left(theirs.keys, width, -2)]
            )
            mine.values = torch.cat(
                [_pad_left(mine.values, width, -2), _pad_left(theirs.values, width, -2)]
            )
        return _Rows(
            cache=self.cache,
            logits_R_V=torch.cat([self.logits_R_V, other.logits_R_V]),
            mask_R_L=torch.cat(
                [_pad_left(self.mask_R_L, width, -1), _pad_left(other.mask_R_L, width, -1)]
            ),
            next_R=torch.cat([self.next_R, other.next_R]),
            adapters=self.adapters.merged(other.adapters),
        )


def _prefill_logits(jobs: Sequence[tuple[Key, SampleJob]]) -> int:
    """Rows x positions of the logits that one prefill of `jobs` keeps (see `_prefill`)."""
    keeps_J = [job.scoring.logits_to_keep(len(job.prompt)) for _, job in jobs]
    kept = max(len(job.prompt) for _, job in jobs) if 0 in keeps_J else max(keeps_J)
    return len(jobs) * kept


def _check_layer_types(config: PreTrainedConfig) -> None:
    """ValidationError unless every attention layer of a model with `config` is one whose cache
    can grow as a plain `DynamicLayer` (`_LAYER_TYPES`)."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    other = sorted(set(layer_types) - _LAYER_TYPES)
    if other:
        raise ValidationError(
            f"this base model has {', '.join(other)} layers; batched sampling supports only "
            f"{' and '.join(sorted(_LAYER_TYPES))} layers, so sample a base model whose layers "
            "are all of those types"
        )


def _kv_layers(cache: DynamicCache) -> list[_KV]:
    """The cache's layers, each a plain growing key/value pair (`_LAYER_TYPES`); rows can then
    be cropped and merged column by column."""
    layers = list(cache.layers)
    assert all(type(layer) is DynamicLayer for layer in layers), layers
    return cast(list[_KV], layers)


class _KV(Protocol):
    keys: torch.Tensor
    values: torch.Tensor


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zeros before its first column along `dim` (-1 or -2) up to `width` columns."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = (missing, 0) if dim == -1 else (0, 0, missing, 0)
    return F.pad(t, pad)


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
