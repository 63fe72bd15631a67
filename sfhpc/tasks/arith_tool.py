"""``arith-tool``: arithmetic word problems on two-digit numbers, solved by calling a calculator tool.

    task:
      name: arith-tool
      options: {operators: "+-*", max_turns: 3}

The policy is offered one function tool, ``calculator`` (an ``expression`` of numbers, ``+ - * /`` and
parentheses). A reply that calls it gets each call's result as a ``tool`` message and the episode goes on;
the first reply without a call is the answer, judged by its final number (the ``numeric`` reward of
`sfhpc.tasks.rewards`). An episode that has not answered after `max_turns` replies gets 0. The numbers are
two-digit, so a small policy cannot answer without the tool: the reward is what it makes of the tool.

Each problem is told with a verb that decides its operator (``found`` or ``got``: ``+``; ``lost`` or
``used``: ``-``; ``bags of``: ``*``), the question first and the facts last, as in ``arith-word``.

The format warm start (``model.warm_start_steps``) teaches the call and the answer, not the operator: the
call holds the question's own numbers with an operator drawn at random, the tool's (right) result for that
expression follows, and the answer restates it. So the reward starts near one in ``len(operators)``, and RL
learns to read the operator from the question.
"""

from __future__ import annotations

import ast
import json
import operator
import random
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
# Its schema is short: the template writes it into every prompt, which a small model reads on every turn.
CALCULATOR = {
    "type": "function",
    "function": {"name": "calculator", "description": "Arithmetic.",
                 "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}},
}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_LONGEST_EXPRESSION = 200  # characters: a tiny policy writes anything; the tool stays cheap


def calculate(expression: str) -> str:
    """The calculator tool: the value of an expression of numbers, ``+ - * /``, unary minus and parentheses
    (nothing else is evaluated), as text; an ``error: ...`` text for anything else."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")

    if len(expression) > _LONGEST_EXPRESSION:
        return f"error: an expression of at most {_LONGEST_EXPRESSION} characters"
    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def call_result(call: Any) -> str:
    """What the tool answers to one call as the agent received it (OpenAI's shape)."""
    function = call.get("function", {}) if isinstance(call, dict) else {}
    if function.get("name") != "calculator":
        return f"error: no tool named {function.get('name')!r}; the tool is calculator"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str):
        return "error: calculator takes {\"expression\": \"...\"}"
    return calculate(expression)


class _ToolEpisode(Episode):
    def __init__(self, question: str, answer: int) -> None:
        self.question, self.answer = question, answer

    def opening(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.question}]

    def step(self, reply: str) -> StepResult:
        return StepResult(done=True, reward=numeric(reply, self.answer))

    def step_message(self, message: dict[str, Any]) -> StepResult:
        calls = message.get("tool_calls") or []
        if not calls:
            return self.step(message.get("content") or "")
        return StepResult(done=False, messages=tuple(
            {"role": "tool", "tool_call_id": call.get("id", ""), "content": call_result(call)} for call in calls))


class ArithToolTask(Task):
    name = "arith-tool"
    max_reply_tokens = 24
    tools = [CALCULATOR]

    def __init__(self, operators: str = "+-*", max_turns: int = 3) -> None:
        if not operators or set(operators) - set(WORDINGS):
            raise TypeError(f"operators must be some of {''.join(WORDINGS)!r}, found {operators!r}")
        if max_turns < 2:
            raise TypeError("max_turns must be at least 2 (a call, then the answer)")
        self.operators, self.max_turns = tuple(dict.fromkeys(operators)), max_turns

    def sample(self, rng: random.Random) -> Problem:
        sign = rng.choice(self.operators)
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        if sign == "-" and a < b:
            a, b = b, a
        question = rng.choice(WORDINGS[sign]).format(name=rng.choice(NAMES), things=rng.choice(THINGS), a=a, b=b)
        return Problem(key=question, data=(question, int(calculate(f"{a} {sign} {b}")), a, b))

    def episode(self, problem: Problem) -> Episode:
        question, answer, _, _ = problem.data
        return _ToolEpisode(question, answer)

    def warm_start_examples(self, rng: random.Random, count: int) -> list[list[dict[str, Any]]]:
        examples = []
        for index in range(count):
            question, _, a, b = self.sample(rng).data
            expression = f"{a} {rng.choice(self.operators)} {b}"  # the operator is RL's to learn
            call_id = f"call_{index}"
            arguments = json.dumps({"expression": expression})
            result = calculate(expression)
            examples.append([
                {"role": "user", "content": question},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": call_id, "content": result},
                {"role": "assistant", "content": result},
            ])
        return examples
