"""The calculator tool of the tool-using example agents: one function, ``calculate(expression)``, that
evaluates arithmetic (numbers, + - * / // %, powers up to 3 digits, parentheses) and nothing else.

Shared by the example agents (calculator_openai.py, calculator_agents_sdk.py, calculator_langchain.py), each
of which offers it to the policy through its own framework."""

import ast
import operator

TOOL = {"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression such as '(3 + 4) * 2' and return the number.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 999:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError("only numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """The expression's value as text (an integer when it is one), or 'error: ...'."""
    try:
        value = _value(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
