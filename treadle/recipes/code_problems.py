"""The small Python problems code_rl trains on, the code block a reply must hold, and the reward.

Forty one-line functions ("return the sum of a list", "reverse a string", "is n even"), each with
a one-sentence task and 3-5 assert-based tests, easy enough that SmolLM2-135M-Instruct solves
some of them before training. A fixed split: 30 to train on, 10 held out (tasks of the same kind,
never trained on). Each problem's first test is its visible test (what code_rl's check_solution
tool runs); all of its tests, the visible one included, are the hidden tests that decide the
reward: 1 if every test passes in the sandbox, 0 if any fails, -0.1 if the reply holds no
```python code block at all. HumanEval's problems (treadle.recipes.humaneval) are Problems too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from treadle.recipes.sandbox import LocalSandbox, Result, Sandbox

SYSTEM = (
    "You are a Python programmer. Reply with the complete function in one ```python code block "
    "and nothing else."
)
NO_CODE_REWARD = -0.1
LOCAL = LocalSandbox()


@dataclass(frozen=True)
class Problem:
    name: str  # the function the tests call
    prompt: str  # the user's message: what to write
    tests: str  # the hidden tests: all of them; they decide the reward
    visible_tests: str  # the tests check_solution runs and shows the model
    preamble: str = ""  # code run before the reply's (the imports a HumanEval prompt starts with)

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.prompt}]


def _p(signature: str, task: str, *asserts: str) -> Problem:
    tests = [f"assert {a}\n" for a in asserts]
    prompt = f"Write a Python function `{signature}` that {task}"
    return Problem(signature.split("(")[0], prompt, "".join(tests), tests[0])


PROBLEMS = [
    _p("add(a, b)", "returns the sum of a and b.",
       "add(1, 2) == 3", "add(-4, 4) == 0", "add(10, 5) == 15"),
    _p("subtract(a, b)", "returns a minus b.",
       "subtract(5, 3) == 2", "subtract(0, 4) == -4", "subtract(10, 10) == 0"),
    _p("multiply(a, b)", "returns the product of a and b.",
       "multiply(3, 4) == 12", "multiply(-2, 5) == -10", "multiply(7, 0) == 0"),
    _p("square(n)", "returns n squared.", "square(3) == 9", "square(-4) == 16", "square(0) == 0"),
    _p("cube(n)", "returns n cubed.", "cube(2) == 8", "cube(-3) == -27", "cube(1) == 1"),
    _p("double(n)", "returns twice n.", "double(4) == 8", "double(-3) == -6", "double(0) == 0"),
    _p("increment(n)", "returns n plus one.",
       "increment(1) == 2", "increment(-1) == 0", "increment(99) == 100"),
    _p("is_even(n)", "returns True if n is even and False otherwise.",
       "is_even(4) is True", "is_even(7) is False", "is_even(0) is True", "is_even(-2) is True"),
    _p("is_odd(n)", "returns True if n is odd and False otherwise.",
       "is_odd(3) is True", "is_odd(8) is False", "is_odd(-5) is True", "is_odd(0) is False"),
    _p("is_positive(n)", "returns True if n is greater than zero and False otherwise.",
       "is_positive(5) is True", "is_positive(-2) is False", "is_positive(0) is False"),
    _p("is_negative(n)", "returns True if n is less than zero and False otherwise.",
       "is_negative(-1) is True", "is_negative(3) is False", "is_negative(0) is False"),
    _p("max_of_two(a, b)", "returns the larger of a and b.",
       "max_of_two(3, 7) == 7", "max_of_two(9, 2) == 9", "max_of_two(-1, -5) == -1"),
    _p("min_of_two(a, b)", "returns the smaller of a and b.",
       "min_of_two(3, 7) == 3", "min_of_two(9, 2) == 2", "min_of_two(-1, -5) == -5"),
    _p("absolute(n)", "returns the absolute value of n.",
       "absolute(-5) == 5", "absolute(3) == 3", "absolute(0) == 0"),
    _p("remainder(a, b)", "returns the remainder of a divided by b.",
       "remainder(7, 3) == 1", "remainder(10, 5) == 0", "remainder(9, 4) == 1"),
    _p("power(a, b)", "returns a raised to the power b.",
       "power(2, 3) == 8", "power(5, 0) == 1", "power(3, 2) == 9"),
    _p("is_divisible(a, b)", "returns True if a is divisible by b and False otherwise.",
       "is_divisible(10, 5) is True", "is_divisible(7, 2) is False", "is_divisible(9, 3) is True"),
    _p("list_sum(nums)", "returns the sum of the numbers in the list nums.",
       "list_sum([1, 2, 3]) == 6", "list_sum([]) == 0", "list_sum([-1, 1, 5]) == 5"),
    _p("list_max(nums)", "returns the largest number in the list nums.",
       "list_max([1, 5, 3]) == 5", "list_max([-4, -2, -9]) == -2", "list_max([7]) == 7"),
    _p("list_min(nums)", "returns the smallest number in the list nums.",
       "list_min([4, 1, 3]) == 1", "list_min([-4, -2, -9]) == -9", "list_min([7]) == 7"),
    _p("list_length(items)", "returns the number of items in the list items.",
       "list_length([1, 2, 3]) == 3", "list_length([]) == 0", "list_length(['a']) == 1"),
    _p("average(nums)", "returns the average of the numbers in the list nums.",
       "average([1, 2, 3]) == 2", "average([4]) == 4", "abs(average([1, 2]) - 1.5) < 1e-9"),
    _p("first_element(items)", "returns the first item of the list items.",
       "first_element([3, 4, 5]) == 3", "first_element(['x', 'y']) == 'x'", "first_element([0]) == 0"),
    _p("last_element(items)", "returns the last item of the list items.",
       "last_element([3, 4, 5]) == 5", "last_element(['x', 'y']) == 'y'", "last_element([0]) == 0"),
    _p("contains(items, x)", "returns True if x is in the list items and False otherwise.",
       "contains([1, 2, 3], 2) is True", "contains([1, 2, 3], 9) is False",
       "contains([], 1) is False"),
    _p("is_empty(items)", "returns True if the list items is empty and False otherwise.",
       "is_empty([]) is True", "is_empty([0]) is False", "is_empty([1, 2]) is False"),
    _p("count_evens(nums)", "returns how many numbers in the list nums are even.",
       "count_evens([1, 2, 4]) == 2", "count_evens([]) == 0", "count_evens([1, 3, 5]) == 0",
       "count_evens([2, 2, 3]) == 2"),
    _p("double_all(nums)", "returns a new list with every number in nums doubled.",
       "double_all([1, 2, 3]) == [2, 4, 6]", "double_all([]) == []", "double_all([-1]) == [-2]"),
    _p("filter_positive(nums)", "returns a list of the numbers in nums that are greater than zero.",
       "filter_positive([1, -2, 3]) == [1, 3]", "filter_positive([-1, 0]) == []",
       "filter_positive([5]) == [5]"),
    _p("sort_list(nums)", "returns the numbers in nums sorted from smallest to largest.",
       "sort_list([3, 1, 2]) == [1, 2, 3]", "sort_list([]) == []", "sort_list([5, -1]) == [-1, 5]"),
    _p("sum_to_n(n)", "returns the sum of the integers from 1 to n.",
       "sum_to_n(3) == 6", "sum_to_n(1) == 1", "sum_to_n(10) == 55"),
    _p("factorial(n)", "returns n factorial.",
       "factorial(0) == 1", "factorial(3) == 6", "factorial(5) == 120"),
    _p("reverse_string(s)", "returns the string s reversed.",
       "reverse_string('abc') == 'cba'", "reverse_string('') == ''",
       "reverse_string('hello') == 'olleh'"),
    _p("to_upper(s)", "returns the string s in upper case.",
       "to_upper('abc') == 'ABC'", "to_upper('Hi!') == 'HI!'", "to_upper('') == ''"),
    _p("to_lower(s)", "returns the string s in lower case.",
       "to_lower('ABC') == 'abc'", "to_lower('Hi!') == 'hi!'", "to_lower('') == ''"),
    _p("string_length(s)", "returns the number of characters in the string s.",
       "string_length('abc') == 3", "string_length('') == 0", "string_length('hi there') == 8"),
    _p("first_char(s)", "returns the first character of the string s.",
       "first_char('hello') == 'h'", "first_char('Z') == 'Z'", "first_char('ab') == 'a'"),
    _p("concat(a, b)", "returns the string a followed by the string b.",
       "concat('ab', 'cd') == 'abcd'", "concat('', 'x') == 'x'", "concat('hi', '') == 'hi'"),
    _p("repeat_string(s, n)", "returns the string s repeated n times.",
       "repeat_string('ab', 3) == 'ababab'", "repeat_string('x', 0) == ''",
       "repeat_string('z', 1) == 'z'"),
    _p("count_char(s, c)", "returns how many times the character c appears in the string s.",
       "count_char('banana', 'a') == 3", "count_char('abc', 'z') == 0",
       "count_char('aaa', 'a') == 3"),
]  # fmt: skip

HELD_OUT_NAMES = frozenset({
    "subtract", "cube", "is_odd", "min_of_two", "list_min", "last_element", "count_evens",
    "to_lower", "repeat_string", "is_negative",
})  # fmt: skip
TRAIN = [p for p in PROBLEMS if p.name not in HELD_OUT_NAMES]
HELD_OUT = [p for p in PROBLEMS if p.name in HELD_OUT_NAMES]

# A correct body for each problem: the tests' check that each problem's tests accept it, and
# code_rl's --warmup-steps demonstrations (train problems only).
SOLUTIONS = {
    "add": "return a + b", "subtract": "return a - b", "multiply": "return a * b",
    "square": "return n * n", "cube": "return n ** 3", "double": "return 2 * n",
    "increment": "return n + 1", "is_even": "return n % 2 == 0", "is_odd": "return n % 2 == 1",
    "is_positive": "return n > 0", "is_negative": "return n < 0", "max_of_two": "return max(a, b)",
    "min_of_two": "return min(a, b)", "absolute": "return abs(n)", "remainder": "return a % b",
    "power": "return a ** b", "is_divisible": "return a % b == 0", "list_sum": "return sum(nums)",
    "list_max": "return max(nums)", "list_min": "return min(nums)",
    "list_length": "return len(items)", "average": "return sum(nums) / len(nums)",
    "first_element": "return items[0]", "last_element": "return items[-1]",
    "contains": "return x in items", "is_empty": "return len(items) == 0",
    "count_evens": "return sum(1 for x in nums if x % 2 == 0)",
    "double_all": "return [2 * x for x in nums]",
    "filter_positive": "return [x for x in nums if x > 0]", "sort_list": "return sorted(nums)",
    "sum_to_n": "return n * (n + 1) // 2",
    "factorial": "return 1 if n == 0 else n * factorial(n - 1)",
    "reverse_string": "return s[::-1]", "to_upper": "return s.upper()",
    "to_lower": "return s.lower()", "string_length": "return len(s)",
    "first_char": "return s[0]", "concat": "return a + b", "repeat_string": "return s * n",
    "count_char": "return s.count(c)",
}  # fmt: skip


def reference_solution(problem: Problem, body: str | None = None) -> str:
    """The problem's function with `body` (default: its SOLUTIONS entry) as its one line."""
    signature = problem.prompt.split("`")[1]  # "Write a Python function `add(a, b)` that ..."
    return f"def {signature}:\n    {body or SOLUTIONS[problem.name]}\n"


_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(reply: str) -> str | None:
    """The first fenced code block of the reply (```python, ```py or a bare ```), or None when
    there is none; a block the reply never closes does not count."""
    match = _BLOCK.search(reply)
    return match.group(1) if match else None


def reward(problem: Problem, reply: str, sandbox: Sandbox = LOCAL) -> tuple[float, Result | None]:
    """1.0 if the reply's code passes all of the problem's hidden tests, 0.0 if not, -0.1 without
    a code block (then no sandbox run, and None in place of its result)."""
    code = extract_code(reply)
    if code is None:
        return NO_CODE_REWARD, None
    result = sandbox.run(problem.preamble + code, problem.tests)
    return (1.0 if result.passed else 0.0), result
