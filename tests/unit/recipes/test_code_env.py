"""code_rl's two-turn environment (treadle/recipes/code_env.py) on SmolLM2's tokenizer: a
check_solution call answered with the visible tests' results, the final reply graded on the
hidden tests, and an episode's datum weighted on exactly the model's own tokens of the rendered
conversation; unreadable calls and failing candidates or sandboxes are turns, not exceptions."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from treadle.client.tool_calls import assistant_weights, render  # noqa: E402
from treadle.platform.models.tokenizers import load_tokenizer  # noqa: E402
from treadle.recipes.code_env import (  # noqa: E402
    CHECK_SOLUTION,
    CodeEnv,
    _mistake,
    demonstration,
)
from treadle.recipes.code_problems import (  # noqa: E402
    HELD_OUT,
    LOCAL,
    PROBLEMS,
    SOLUTIONS,
    TRAIN,
    reference_solution,
)
from treadle.recipes.common.envs import (  # noqa: E402
    Action,
    Episode,
    Turn,
    episode_datums,
    sequences,
)
from treadle.recipes.sandbox import Limits, LocalSandbox, Result  # noqa: E402

ADD = next(p for p in PROBLEMS if p.name == "add")
WRONG = "```python\ndef add(a, b):\n    return a * b\n```"
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"
CALL = '<tool_call>\n{"name": "check_solution", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(cache_dir: Path) -> Any:
    return load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir)


def sampled(tok: Any, text: str) -> Action:
    """A reply as the sampler returns it: the text's tokens, then the end of turn."""
    tokens = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    return Action(tokens, [-0.5] * len(tokens), text, "stop")


def play(env: CodeEnv, replies: list[Action]) -> Episode:
    turns, observation = [], env.observation()
    for action in replies:
        outcome = env.step(action)
        turns.append(Turn(observation, action, outcome.reward, outcome.info))
        if outcome.done:
            assert action is replies[-1]
            return Episode(turns)
        assert outcome.observation is not None
        observation = outcome.observation
    raise AssertionError("the episode did not end")


def test_a_call_gets_the_visible_results_and_the_revision_is_graded_on_the_hidden_tests(
    tok: Any,
) -> None:
    env = CodeEnv(ADD, tok, LocalSandbox())
    episode = play(env, [sampled(tok, f"{WRONG}\n{CALL}"), sampled(tok, RIGHT)])
    first, second = episode.turns
    assert first.reward == 0.0 and first.info["tool_calls"] == [{}]
    assert first.info["tool_results"][0].startswith("Visible tests: failed")
    assert "AssertionError" in first.info["tool_results"][0]
    assert (second.reward, second.info["outcome"], episode.reward) == (1.0, "passed", 1.0)
    # The tool's answer is in the second prompt, rendered in the model's format.
    assert "<tool_response>\nVisible tests: failed" in tok.decode(second.observation)


def test_a_two_turn_episode_trains_only_the_models_own_tokens(tok: Any) -> None:
    env = CodeEnv(ADD, tok, LocalSandbox())
    episode = play(env, [sampled(tok, f"{WRONG}\n{CALL}"), sampled(tok, RIGHT)])
    conversation = [*env.messages, {"role": "assistant", "content": RIGHT}]
    tokens, weights = assistant_weights(tok, conversation, [CHECK_SOLUTION])
    # The worked example's assistant turns precede the episode's prompt: not the model's own.
    start = len(episode.turns[0].observation)
    assert weights[:start] != [0.0] * start
    weights[:start] = [0.0] * start
    (seq,) = sequences(episode)  # the second prompt extends the first turn: one sequence
    n = len(seq.tokens)
    assert seq.tokens == tokens[:n] and seq.mask == weights[:n]
    assert not tok.decode(tokens[n:]).strip()  # only the template's newline after the end
    assert sum(seq.mask) == sum(len(t.action.tokens) for t in episode.turns)
    (datum,) = episode_datums(episode, 0.5)
    assert datum.model_input.to_ints() == seq.tokens[:-1]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == seq.tokens[1:]
    assert datum.loss_fn_inputs["advantages"].tolist() == [0.5 * m for m in seq.mask[1:]]
    assert datum.loss_fn_inputs["logprobs"].tolist() == [-0.5 * m for m in seq.mask[1:]]


def test_a_reply_without_a_call_is_final(tok: Any) -> None:
    episode = play(CodeEnv(ADD, tok, LocalSandbox()), [sampled(tok, RIGHT)])
    assert [t.reward for t in episode.turns] == [1.0]
    assert play(CodeEnv(ADD, tok, LocalSandbox()), [sampled(tok, "no code")]).reward == -0.1


def test_one_turn_offers_no_tool(tok: Any) -> None:
    env = CodeEnv(ADD, tok, LocalSandbox(), max_turns=1)
    assert "check_solution" not in tok.decode(env.observation())
    assert env.observation() == render(tok, ADD.messages, add_generation_prompt=True)
    assert play(env, [sampled(tok, f"{WRONG}\n{CALL}")]).reward == 0.0  # graded, not called


def test_an_unreadable_call_is_a_failed_turn(tok: Any) -> None:
    episode = play(CodeEnv(ADD, tok, LocalSandbox()), [sampled(tok, "<tool_call>\n{oops")])
    assert episode.reward == -0.1 and episode.final.info["outcome"] == "unreadable tool call"
    assert "never closed" in episode.final.info["error"]


def test_a_candidate_that_hangs_returns_its_timeout_to_the_model(tok: Any) -> None:
    env = CodeEnv(ADD, tok, LocalSandbox(Limits(cpu_seconds=1, wall_seconds=3)))
    hangs = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    outcome = env.step(sampled(tok, f"{hangs}\n{CALL}"))
    assert not outcome.done and outcome.info["tool_results"][0].startswith("Visible tests: timeout")


class Unreachable:
    """A remote sandbox whose service is down (the Sandbox interface's failure)."""

    def run(self, code: str, tests: str) -> Result:
        raise ConnectionError("sandbox service at http://sandbox:8080 refused the connection")


def test_a_sandbox_that_fails_is_reported_to_the_model(tok: Any) -> None:
    outcome = CodeEnv(ADD, tok, Unreachable()).step(sampled(tok, f"{RIGHT}\n{CALL}"))
    assert not outcome.done
    assert outcome.info["tool_results"] == [
        "check_solution could not run the tests: ConnectionError: sandbox service at "
        "http://sandbox:8080 refused the connection"
    ]


def test_a_turn_the_next_prompt_does_not_extend_trains_as_a_datum_of_its_own(tok: Any) -> None:
    """A first reply whose tokens are not the ones the template renders for its text (sampled
    one character a token, which decodes to the same text) cannot be joined with the second
    prompt: each turn is a datum of its own, on the prompt the model actually saw."""
    env = CodeEnv(ADD, tok, LocalSandbox())
    text = f"{WRONG}\n{CALL}"
    tokens = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]
    tokens.append(tok.eos_token_id)
    assert tok.decode(tokens, skip_special_tokens=True) == text
    cut = Action(tokens, [-0.5] * len(tokens), text, "stop")
    episode = play(env, [cut, sampled(tok, RIGHT)])
    first, second = sequences(episode)
    assert first.tokens == [*episode.turns[0].observation, *cut.tokens]
    assert second.tokens[: len(episode.turns[1].observation)] == episode.turns[1].observation
    assert [sum(s.mask) for s in (first, second)] == [len(t.action.tokens) for t in episode.turns]
    assert len(episode_datums(episode, 1.0)) == 2


@pytest.mark.parametrize("first_wrong", [False, True])
def test_a_demonstration_is_the_two_turn_episode_played_right(tok: Any, first_wrong: bool) -> None:
    """--warmup-steps' example: the first reply's call parses as the model's would, the tool's
    answer is the sandbox's verdict on that reply, the final reply passes the hidden tests, and
    only the model's own turns carry weight."""
    problem = next(p for p in PROBLEMS if p.name == "add")
    sandbox = LocalSandbox(Limits(cpu_seconds=2, wall_seconds=5))
    tokens, weights = demonstration(problem, tok, sandbox, first_wrong=first_wrong)
    env = CodeEnv(problem, tok, sandbox)
    prompt = env.observation()
    assert tokens[: len(prompt)] == prompt and not any(weights[: len(prompt)])
    text = tok.decode(tokens[len(prompt) :])
    first_reply = text.split("<|im_end|>")[0]
    played = env.step(sampled(tok, first_reply))  # the environment reads the call
    assert not played.done and played.info["tool_calls"] == [{}]
    verdict = played.info["tool_results"][0]
    assert (verdict == "All visible tests passed.") is (not first_wrong)
    assert verdict in text
    final = env.step(sampled(tok, text.split("<|im_end|>")[2].split("assistant\n", 1)[1]))
    assert final.done and final.reward == 1.0
    ours, mask = assistant_weights(tok, env.messages + [
        {"role": "assistant", "content": text.split("<|im_end|>")[2].split("assistant\n", 1)[1]}
    ], env.tools)  # fmt: skip
    assert ours == tokens and mask[len(prompt) :] == weights[len(prompt) :]


def test_a_demonstrations_wrong_first_attempt_fails_and_shows_no_held_out_solution() -> None:
    held_out = {SOLUTIONS[p.name] for p in HELD_OUT} - {SOLUTIONS[p.name] for p in TRAIN}
    for problem in TRAIN:
        body = _mistake(problem)
        assert body not in held_out, problem.name
        code = reference_solution(problem, body)
        assert not LOCAL.run(code, problem.visible_tests).passed, problem.name
