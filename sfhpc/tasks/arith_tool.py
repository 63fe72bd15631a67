"""``arith-tool``: arithmetic word problems on two-digit numbers, answered by calling the right tool.

    task:
      name: arith-tool
      options: {operators: "+-*", max_turns: 3, tools: operators}

The policy is offered one function tool per operator, ``add``, ``subtract`` and ``multiply`` (``a`` and
``b``, numbers), or with ``tools: calculator`` one, ``calculate`` (``expression``, a string such as ``"43 -
12"``), the tool of the shipped example agents (``recipes/agents/calculator.py``), so that an agent program
written with any framework offers the tool the policy was warm-started on. A reply that calls one gets
each call's result as a ``tool`` message and the episode goes on; the first reply without a call is the
answer, judged by its final number (the ``numeric`` reward of `sfhpc.tasks.rewards`). An episode that has
not answered after `max_turns` replies gets 0. The numbers are two-digit, so a small policy cannot answer
without a tool: the reward is what it makes of the tools.

Each problem is told with a verb that decides its operator (``found`` or ``got``: add; ``lost`` or
``used``: subtract; ``bags of``: multiply), the question first and the facts last, as in ``arith-word``.
The choice of tool is the reply's first free token, a few tokens after that verb.

The format warm start (``model.build.warm_start_steps``) teaches the call and the answer from a sloppy
demonstrator: each example calls the right tool one time in ``len(operators)`` and otherwise the next
operator's (``multiply`` for a ``lost``, say), with the question's own numbers; the tool's (right) result follows,
and the answer restates it. So the reward starts near one in ``len(operators)``, the reply already reads
the verb, and RL learns which tool it asks for. (A tool drawn at random instead taught the model that the
choice does not depend on the question: after 20 steps of RL it still picked the right one a third of the
time, as `arith-word`'s bare-number warm start taught its model to ignore the question.)
"""

from __future__ import annotations

import json
import operator
import random
import re
from collections.abc import Callable
from typing import Any

from sfhpc.tasks.base import Episode, Problem, StepResult, Task
from sfhpc.tasks.rewards import numeric

NAMES = ("Ann", "Ben", "Cal", "Dot", "Eve", "Fay", "Gus", "Hal")
THINGS = ("apples", "cards", "coins", "pens", "eggs", "cups")
WORDINGS = {
    "+": ("How many {things} does {name} have now? {name} had {a}, then found {b}.",
          "How many {things} are there now? {name} had {a}, then got {b}."),
    "-": ("How many {things} does {name} have now? {name} had {a}, then lost {b}.",
          "How many {things} are there now? {name} had {a}, then used {b}."),
    "*": ("How many {things} does {name} have now? {name} has {a} bags of {b}.",
          "How many {things} are there now? {name} got {a} bags of {b}."),
}
FUNCTIONS: dict[str, tuple[str, Callable[[Any, Any], Any]]] = {
    "+": ("add", operator.add), "-": ("subtract", operator.sub), "*": ("multiply", operator.mul)}


def tool(sign: str) -> dict[str, Any]:
    """The function tool of one operator, in OpenAI's shape. Its schema is short: the template writes it
    into every prompt, which a small model reads on every turn."""
    return {"type": "function", "function": {
        "name": FUNCTIONS[sign][0], "description": f"a {sign} b",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}}


CALCULATOR = {"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression such as '(3 + 4) * 2' and return the number.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
_EXPRESSION = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*([-+*])\s*(-?\d+(?:\.\d+)?)\s*")


def calculator_result(call: Any) -> str:
    """What ``calculate`` answers to one call: the value of ``a op b`` (the only expressions these problems
    need), or an ``error: ...`` text."""
    function = call.get("function", {}) if isinstance(call, dict) else {}
    if function.get("name") != "calculate":
        return f"error: no tool named {function.get('name')!r}; the tool is calculate"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    found = _EXPRESSION.fullmatch(str(arguments.get("expression", ""))) if isinstance(arguments, dict) else None
    if found is None:
        return "error: the arguments are {\"expression\": \"<number> <+ - *> <number>\"}"
    a, sign, b = float(found[1]), found[2], float(found[3])
    result = FUNCTIONS[sign][1](a, b)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def call_result(call: Any) -> str:
    """What the tools answer to one call as the agent received it (OpenAI's shape): the result as text, or
    an ``error: ...`` text."""
    function = call.get("function", {}) if isinstance(call, dict) else {}
    by_name = {name: apply for name, apply in FUNCTIONS.values()}
    if function.get("name") not in by_name:
        return f"error: no tool named {function.get('name')!r}; the tools are {', '.join(by_name)}"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    numbers = [arguments.get(k) for k in ("a", "b")] if isinstance(arguments, dict) else []
    if len(numbers) != 2 or not all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers):
        return "error: the arguments are {\"a\": <number>, \"b\": <number>}"
    result = by_name[function["name"]](*numbers)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


class _ToolEpisode(Episode):
    def __init__(self, question: str, answer: int, result: Callable[[Any], str]) -> None:
        self.question, self.answer, self.result = question, answer, result

    def opening(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.question}]

    def step(self, reply: str) -> StepResult:
        return StepResult(done=True, reward=numeric(reply, self.answer))

    def step_message(self, message: dict[str, Any]) -> StepResult:
        calls = message.get("tool_calls") or []
        if not calls:
            return self.step(message.get("content") or "")
        return StepResult(done=False, messages=tuple(
            {"role": "tool", "tool_call_id": call.get("id", ""), "content": self.result(call)} for call in calls))


class ArithToolTask(Task):
    name = "arith-tool"
    max_reply_tokens = 40  # a call is about 25 tokens; a cut one is no call

    def __init__(self, operators: str = "+-*", max_turns: int = 3, tools: str = "operators") -> None:
        if not operators or set(operators) - set(WORDINGS):
            raise TypeError(f"operators must be some of {''.join(WORDINGS)!r}, found {operators!r}")
        if max_turns < 2:
            raise TypeError("max_turns must be at least 2 (a call, then the answer)")
        if tools not in ("operators", "calculator"):
            raise TypeError(f"tools must be 'operators' (one per operator) or 'calculator', found {tools!r}")
        self.operators, self.max_turns = tuple(dict.fromkeys(operators)), max_turns
        self.calculator = tools == "calculator"
        self.tools = [CALCULATOR] if self.calculator else [tool(sign) for sign in self.operators]

    def sample(self, rng: random.Random) -> Problem:
        sign = rng.choice(self.operators)
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        if sign == "-" and a < b:
            a, b = b, a
        question = rng.choice(WORDINGS[sign]).format(name=rng.choice(NAMES), things=rng.choice(THINGS), a=a, b=b)
        return Problem(key=question, data=(question, FUNCTIONS[sign][1](a, b), a, b, sign))

    def problem_from_json(self, value: list[Any]) -> tuple[Any, ...]:
        return tuple(value)

    def episode(self, problem: Problem) -> Episode:
        question, answer, *_ = problem.data
        return _ToolEpisode(question, answer, calculator_result if self.calculator else call_result)

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, Any]]]:
        examples = []
        for index in range(count):
            question, _, a, b, sign = self.sample(rng).data
            if rng.random() >= 1 / len(self.operators):  # the demonstrator's mistake: the next operator's tool
                sign = self.operators[(self.operators.index(sign) + 1) % len(self.operators)]
            name, apply = FUNCTIONS[sign]
            call_id = f"call_{index}"
            result = str(apply(a, b))
            function = ({"name": "calculate", "arguments": json.dumps({"expression": f"{a} {sign} {b}"})}
                        if self.calculator else {"name": name, "arguments": json.dumps({"a": a, "b": b})})
            examples.append([
                {"role": "user", "content": question},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function",
                                                                     "function": function}]},
                {"role": "tool", "tool_call_id": call_id, "content": result},
                {"role": "assistant", "content": result},
            ])
        return examples
