"""code_rl's environment: a problem, up to two turns, and a `check_solution` tool.

The model sees the problem with the tool offered, rendered in its own chat format
(treadle.client.tool_calls.render). On the first turn it may call `check_solution`: the
candidate (the call's `code` argument, or else the reply's ```python block) runs against the
problem's visible tests in the sandbox, and the results come back as the tool's message; the
model then has a second, final turn. One worked exchange (EXAMPLE) precedes the problem. A reply
without a tool call is final at once. The final reply is graded on the hidden tests: 1 when all
pass, 0 otherwise, -0.1 when it has no code block (code_problems.reward). A tool call the parser cannot read ends the episode as a failed turn
scored -0.1; a candidate that times out, crashes or is refused is the tool's answer, never an
exception; a sandbox that itself fails is reported to the model the same way.

With max_turns=1 no tool is offered and the problem is the single-turn task it always was.
`demonstration` writes a two-turn episode of a problem with its reference solution (a first
attempt, the call, the tool's real answer, the final code), the supervised examples of
code_rl's --warmup-steps.
"""

from __future__ import annotations

from typing import Any

from treadle.client.tool_calls import (
    ToolCall,
    ToolCallParseError,
    assistant_weights,
    parse_tool_calls,
    render,
)
from treadle.recipes.code_problems import (
    LOCAL,
    NO_CODE_REWARD,
    SOLUTIONS,
    SYSTEM,
    TRAIN,
    Problem,
    extract_code,
    reference_solution,
    reward,
)
from treadle.recipes.common.envs import Action, Outcome
from treadle.recipes.sandbox import Sandbox

TOOL_SYSTEM = (
    "You are a Python programmer. Write the complete function in one ```python code block, then "
    "call check_solution to test it. After the test results, reply with your final code block."
)
# One worked exchange before the problem, in the same rendered format: a first reply with a bug
# and a call, the tool's result, the fixed final reply. A model as small as SmolLM2-135M copies
# a shown exchange; told the format alone, it wrote no call in 16 of 16 samples.
EXAMPLE_CALL = {"id": "call_example", "type": "function",
                "function": {"name": "check_solution", "arguments": {}}}  # fmt: skip
EXAMPLE = [
    {"role": "user", "content": "Write a Python function `triple(n)` that returns n times three."},
    {"role": "assistant", "content": "```python\ndef triple(n):\n    return n + 3\n```",
     "tool_calls": [EXAMPLE_CALL]},
    {"role": "tool", "tool_call_id": "call_example",
     "content": "Visible tests: failed (tests: AssertionError ).\nassert triple(2) == 6"},
    {"role": "assistant", "content": "```python\ndef triple(n):\n    return n * 3\n```"},
]  # fmt: skip
CHECK_SOLUTION = {
    "type": "function",
    "function": {
        "name": "check_solution",
        "description": "Run a candidate solution against the problem's visible tests.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {
                    "type": "string",
                    "description": "the complete function; without it, the reply's code block",
                }
            },
        },
    },
}
UNREADABLE_CALL_REWARD = NO_CODE_REWARD
RESULT_CHARS = 600  # how much of the candidate's error output the tool shows


class CodeEnv:
    """One episode of one problem (common.envs.Env)."""

    def __init__(
        self, problem: Problem, tokenizer: Any, sandbox: Sandbox, *, max_turns: int = 2
    ) -> None:
        if max_turns not in (1, 2):
            raise ValueError(f"max_turns must be 1 or 2, not {max_turns}")
        self.problem, self.tokenizer, self.sandbox = problem, tokenizer, sandbox
        self.max_turns, self.turn = max_turns, 0
        self.tools = [CHECK_SOLUTION] if max_turns > 1 else None
        system = TOOL_SYSTEM if self.tools else SYSTEM
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            *(EXAMPLE if self.tools else []),
            {"role": "user", "content": problem.prompt},
        ]

    def observation(self) -> list[int]:
        return render(self.tokenizer, self.messages, self.tools, add_generation_prompt=True)

    def step(self, action: Action) -> Outcome:
        self.turn += 1
        if self.turn < self.max_turns:
            try:
                text, calls = parse_tool_calls(self.tokenizer, action.text, tools=self.tools)
            except ToolCallParseError as e:
                info = {"outcome": "unreadable tool call", "error": str(e)}
                return Outcome(UNREADABLE_CALL_REWARD, done=True, info=info)
            if calls:
                return self._answer(text, calls)
        value, result = reward(self.problem, action.text, self.sandbox)
        outcome = result.outcome if result else "no code"
        return Outcome(value, done=True, info={"outcome": outcome, "turn": self.turn})

    def _answer(self, text: str, calls: list[ToolCall]) -> Outcome:
        """The tool's results as the next prompt; the turn itself earns nothing."""
        self.messages.append(
            {"role": "assistant", "content": text, "tool_calls": [c.to_openai() for c in calls]}
        )
        results = [self.check_solution(call, text) for call in calls]
        for call, result in zip(calls, results, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        info = {"tool_calls": [c.arguments for c in calls], "tool_results": results}
        return Outcome(0.0, done=False, observation=self.observation(), info=info)

    def check_solution(self, call: ToolCall, text: str) -> str:
        """The tool: the candidate against the visible tests, the verdict in words."""
        code = call.arguments.get("code")
        if not isinstance(code, str):
            code = extract_code(text)
        if code is None:
            return (
                "check_solution found no code: put the function in a ```python block before "
                "the call, or pass it as the `code` argument."
            )
        try:
            result = self.sandbox.run(self.problem.preamble + code, self.problem.visible_tests)
        except Exception as e:  # the sandbox itself failed: the model is told, the run goes on
            return f"check_solution could not run the tests: {type(e).__name__}: {e}"
        if result.passed:
            return "All visible tests passed."
        lines = [f"Visible tests: {result.outcome} ({result.detail})."]
        if result.stderr.strip():
            lines.append(result.stderr.strip()[-RESULT_CHARS:])
        return "\n".join(lines)


def demonstration(
    problem: Problem, tokenizer: Any, sandbox: Sandbox, *, first_wrong: bool
) -> tuple[list[int], list[float]]:
    """A two-turn episode of `problem` as the model should play it, rendered: a first reply
    with a code block (the reference solution, or with `first_wrong` a plausible wrong one:
    `_mistake`) and a call
    to `check_solution`, the tool's answer as the sandbox gives it, and the reference solution
    as the final reply. Returns its tokens and a weight per token: 1 on the model's own
    turns of this episode, 0 elsewhere (`tool_calls.assistant_weights`; the worked example in
    the prompt is not trained on)."""
    env = CodeEnv(problem, tokenizer, sandbox)
    prompt = len(env.observation())
    final = f"```python\n{reference_solution(problem)}```"
    first = (
        f"```python\n{reference_solution(problem, _mistake(problem))}```" if first_wrong else final
    )
    call = ToolCall("call_0", "check_solution", {})
    env.messages += [
        {"role": "assistant", "content": first, "tool_calls": [call.to_openai()]},
        {"role": "tool", "tool_call_id": call.id, "content": env.check_solution(call, first)},
        {"role": "assistant", "content": final},
    ]
    tokens, weights = assistant_weights(tokenizer, env.messages, env.tools)
    return tokens, [0.0] * prompt + weights[prompt:]  # the worked example is the prompt's


def _mistake(problem: Problem) -> str:
    """A plausible wrong body for `problem`: the first other train problem's reference body over
    the same parameters that fails this one's visible test (another problem's solution, as a
    confused first attempt would be; never a held-out one's), else `return None`."""
    params = problem.prompt.split("`")[1].split("(", 1)[1]
    for other in TRAIN:
        if other.name == problem.name or other.prompt.split("`")[1].split("(", 1)[1] != params:
            continue
        body = SOLUTIONS[other.name]
        if not LOCAL.run(reference_solution(problem, body), problem.visible_tests).passed:
            return body
    return "return None"
