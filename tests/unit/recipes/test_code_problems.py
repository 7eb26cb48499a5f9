"""code_rl's problems, code-block extraction and reward: every problem's tests accept a correct
solution and reject a wrong one, the split is fixed, and the reward is 1 / 0 / -0.1."""

from __future__ import annotations

import pytest

from treadle.recipes.code_problems import (
    HELD_OUT,
    NO_CODE_REWARD,
    PROBLEMS,
    SOLUTIONS,
    TRAIN,
    Problem,
    extract_code,
    reference_solution,
    reward,
)


def solution(name: str, body: str) -> str:
    return reference_solution(next(p for p in PROBLEMS if p.name == name), body)


def test_forty_problems_split_thirty_to_train_and_ten_held_out() -> None:
    assert len(PROBLEMS) == 40 and len({p.name for p in PROBLEMS}) == 40
    assert len(TRAIN) == 30 and len(HELD_OUT) == 10
    assert not {p.name for p in TRAIN} & {p.name for p in HELD_OUT}
    assert all(3 <= p.tests.count("assert ") <= 5 for p in PROBLEMS)


def test_the_visible_test_is_the_first_of_the_hidden_ones() -> None:
    for p in PROBLEMS:
        assert p.visible_tests.count("assert ") == 1 and p.tests.startswith(p.visible_tests)


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_each_problem_accepts_a_correct_solution_and_rejects_a_wrong_one(problem: Problem) -> None:
    # Our own trusted code, so run in process: the sandbox's own tests are in test_sandbox.py.
    namespace: dict[str, object] = {}
    exec(solution(problem.name, SOLUTIONS[problem.name]) + problem.tests, namespace)
    with pytest.raises(AssertionError):
        exec(solution(problem.name, "return None") + problem.tests, {})


def test_the_prompt_names_the_function_and_asks_for_a_code_block() -> None:
    messages = PROBLEMS[0].messages
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "`add(a, b)`" in messages[1]["content"] and "```python" in messages[0]["content"]


def test_extract_code_takes_the_first_fenced_block() -> None:
    reply = "Here:\n```python\ndef f():\n    return 1\n```\nand\n```python\nother\n```"
    assert extract_code(reply) == "def f():\n    return 1\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```py\nx = 2\n```") == "x = 2\n"


def test_extract_code_finds_nothing_without_a_closed_block() -> None:
    assert extract_code("def add(a, b):\n    return a + b") is None
    assert extract_code("```python\ndef add(a, b):\n    return a +") is None


def test_reward_is_one_when_all_tests_pass() -> None:
    add = PROBLEMS[0]
    value, result = reward(add, f"```python\n{solution('add', 'return a + b')}```")
    assert value == 1.0 and result is not None and result.passed


def test_reward_is_zero_when_a_test_fails() -> None:
    add = PROBLEMS[0]
    value, result = reward(add, f"```python\n{solution('add', 'return a * b')}```")
    assert value == 0.0 and result is not None and result.outcome == "failed"


def test_reward_is_minus_a_tenth_without_a_code_block() -> None:
    value, result = reward(PROBLEMS[0], "def add(a, b):\n    return a + b")
    assert value == NO_CODE_REWARD == -0.1 and result is None
