"""Environments: what the model sees, how its reply is scored, and whether it gets another turn.

An environment (`Env`) holds one episode's state. `observation()` is the first prompt as tokens;
`step(action)` takes the model's sampled reply and answers with its reward and either the end of
the episode or the next prompt (the conversation so far, the environment's answer included, up to
where the model speaks again). An episode is the list of its turns; a group is the episodes of
one prompt, whose rewards are centred against each other (common.advantages.group_centred).

`run_group` plays a group's episodes turn by turn on a sampling client: all the requests of a
turn are in flight together, and episodes whose prompts are still the same (every first turn of
a group) share one request with `num_samples`. `episode_datums` turns an episode into training
datums that carry the advantage on the model's own tokens only.

Synchronous on purpose (the recipes run groups on threads), with tokens in and out: rendering
messages, parsing replies and tools are each environment's business. Client code: imports
`tinker` and the recipes' own modules, never the platform's server side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tinker import types

from treadle.recipes.common.advantages import group_centred
from treadle.recipes.common.batching import step_seed
from treadle.recipes.common.chat import completion_text

Info = dict[str, Any]


@dataclass(frozen=True)
class Action:
    """One sampled reply: its tokens, the sampler's logprobs of them, the decoded text, and why
    sampling stopped ("stop": an end of turn or a stop sequence; "length": max_tokens)."""

    tokens: list[int]
    logprobs: list[float]
    text: str
    stop_reason: str


@dataclass(frozen=True)
class Outcome:
    """What `Env.step` answers: the reply's reward and, unless `done`, the next prompt.
    `info` says in words what happened (a sandbox's verdict, a tool's result) for the samples
    file; it is not trained on."""

    reward: float
    done: bool
    observation: list[int] | None = None
    info: Info = field(default_factory=dict)


class Env(Protocol):
    """One episode of a task. Single use: made for one episode, stepped until `done`."""

    def observation(self) -> list[int]:
        """The first prompt, as tokens, ending where the model's reply begins."""
        ...

    def step(self, action: Action) -> Outcome:
        """Score the reply; end the episode or give the next prompt (which should extend the
        previous prompt plus the reply's tokens, so the episode trains as one datum)."""
        ...


@dataclass(frozen=True)
class Turn:
    observation: list[int]  # the prompt the model replied to
    action: Action
    reward: float
    info: Info


@dataclass(frozen=True)
class Episode:
    turns: list[Turn]

    @property
    def reward(self) -> float:
        return sum(t.reward for t in self.turns)

    @property
    def final(self) -> Turn:
        return self.turns[-1]


def run_group(
    envs: Sequence[Env],
    sampler: Any,
    tokenizer: Any,
    *,
    max_tokens: int,
    temperature: float,
    seed: int,
    max_turns: int = 8,
) -> list[Episode]:
    """Play every env's episode to its end on `sampler`, turn by turn; one Episode per env.

    Each turn's requests are sent before any is awaited. Episodes that face the same prompt
    share a request (num_samples = how many); the request for the k-th distinct prompt of turn t
    is seeded from (seed, t, k), and turn 0's single request with `seed` itself, so a one-turn
    group samples exactly what one request with `seed` samples. An env still not done after
    `max_turns` turns is a bug in the env (it must end its episodes), and raises.
    """
    observations: dict[int, list[int]] = {i: env.observation() for i, env in enumerate(envs)}
    turns: list[list[Turn]] = [[] for _ in envs]
    for turn in range(max_turns):
        if not observations:
            return [Episode(t) for t in turns]
        prompts: dict[tuple[int, ...], list[int]] = {}
        for i, obs in observations.items():
            prompts.setdefault(tuple(obs), []).append(i)
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(list(prompt)),
                len(members),
                types.SamplingParams(
                    max_tokens=max_tokens,
                    temperature=temperature,
                    seed=seed if turn == 0 and k == 0 else step_seed(seed, turn, k),
                ),
            )  # fmt: skip
            for k, (prompt, members) in enumerate(prompts.items())
        ]
        following: dict[int, list[int]] = {}
        for future, members in zip(futures, prompts.values(), strict=True):
            for i, seq in zip(members, future.result().sequences, strict=True):
                action = Action(
                    list(seq.tokens), list(seq.logprobs or []),
                    completion_text(tokenizer, seq.tokens), str(seq.stop_reason),
                )  # fmt: skip
                outcome = envs[i].step(action)
                turns[i].append(Turn(observations[i], action, outcome.reward, outcome.info))
                if not outcome.done:
                    if outcome.observation is None:
                        raise ValueError(f"env {i} is not done but gave no next observation")
                    following[i] = outcome.observation
        observations = following
    if observations:
        raise RuntimeError(f"{len(observations)} episodes still running after {max_turns} turns")
    return [Episode(t) for t in turns]


@dataclass(frozen=True)
class Sequenced:
    """An episode (or the part of it that extends one prompt) as one token list: `mask` is 1 on
    the model's own sampled tokens and 0 on everything else (prompts, tool results, template
    glue); `logprobs` are the sampler's on masked tokens and 0 elsewhere."""

    tokens: list[int]
    mask: list[float]
    logprobs: list[float]


def sequences(episode: Episode) -> list[Sequenced]:
    """The episode's turns joined where each prompt extends the one before plus its reply (a
    multi-turn conversation rendered by one template); a turn whose prompt does not (a reply cut
    at max_tokens, then re-rendered) starts a sequence of its own."""
    out: list[Sequenced] = []
    for turn in episode.turns:
        reply = turn.action.tokens
        if out and turn.observation[: len(out[-1].tokens)] == out[-1].tokens:
            last = out[-1]
            glue = turn.observation[len(last.tokens) :]
            out[-1] = Sequenced(
                [*last.tokens, *glue, *reply],
                [*last.mask, *[0.0] * len(glue), *[1.0] * len(reply)],
                [*last.logprobs, *[0.0] * len(glue), *turn.action.logprobs],
            )
        else:
            out.append(
                Sequenced(
                    [*turn.observation, *reply],
                    [0.0] * len(turn.observation) + [1.0] * len(reply),
                    [0.0] * len(turn.observation) + list(turn.action.logprobs),
                )
            )
    return out


def episode_datums(episode: Episode, advantage: float) -> list[types.Datum]:
    """The episode as RL datums (target_tokens, logprobs, advantages): the advantage on the
    model's own tokens, 0 on every other token, so only what the model sampled is trained."""
    datums = []
    for seq in sequences(episode):
        if not any(seq.mask[1:]):
            continue  # nothing sampled after the first token (an empty reply)
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": seq.tokens[1:],
                    "logprobs": seq.logprobs[1:],
                    "advantages": [advantage * m for m in seq.mask[1:]],
                },
            )
        )
    return datums


def group_advantages(episodes: Sequence[Episode]) -> list[float]:
    """Each episode's reward minus its group's mean (GRPO)."""
    return group_centred([e.reward for e in episodes])
