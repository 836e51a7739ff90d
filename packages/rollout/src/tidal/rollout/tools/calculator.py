"""The calculator tool: an arithmetic expression evaluated by walking its AST (never `eval`).

Ints and floats, ``+ - * / // % **``, unary ``+ -`` and parentheses; nothing else parses. Bounded so that
a model cannot make the environment process spin or swell: the expression's length, each exponent, and
the magnitude of every intermediate value (checked *before* a power is computed). Its messages use only
characters of the tiny tokenizer's tool alphabet (`tidal.rollout.tiny.TOOL_ALPHABET`), so a char model
can be shown its errors.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from tidal.core.episodes import ToolResult
from tidal.core.protocol import ToolSpec

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.Pow: "**"}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is shown to the model."""


class Calculator:
    """Evaluates one arithmetic expression (argument ``expression``). Integer results print as ints
    (``6/3`` gives ``2``), other floats with up to 12 significant digits."""

    def __init__(self, max_length: int = 200, max_exponent: int = 64, max_magnitude: float = 1e30) -> None:
        if max_length < 1 or max_exponent < 1 or not max_magnitude > 1:
            raise ValueError(f"calculator bounds must be positive (max_magnitude > 1), got max_length={max_length}, "
                             f"max_exponent={max_exponent}, max_magnitude={max_magnitude}")
        self.max_length, self.max_exponent, self.max_magnitude = max_length, max_exponent, max_magnitude
        self.spec = ToolSpec(
            name="calculator",
            description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
            parameters={"type": "object", "required": ["expression"],
                        "properties": {"expression": {"type": "string", "description": "e.g. 347*58"}}})

    def run(self, arguments: Mapping[str, Any]) -> ToolResult:
        start = time.monotonic()
        try:
            value = self.evaluate(arguments.get("expression"))
        except CalculatorError as e:
            return ToolResult(content=str(e), error="bad_arguments", elapsed_s=time.monotonic() - start)
        return ToolResult(content=format_number(value), elapsed_s=time.monotonic() - start)

    def evaluate(self, expression: Any) -> int | float:
        """The expression's value; CalculatorError says why it is refused."""
        if not isinstance(expression, str):
            raise CalculatorError(f"the calculator needs an expression string, got {type(expression).__name__}")
        text = expression.strip()
        if not text:
            raise CalculatorError("empty expression")
        if len(text) > self.max_length:
            raise CalculatorError(f"expression too long: {len(text)} characters (at most {self.max_length})")
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            raise CalculatorError(f"cannot read the expression {text}") from None
        try:
            return self._walk(tree)
        except ZeroDivisionError:
            raise CalculatorError(f"division by zero in {text}") from None
        except OverflowError:
            raise CalculatorError(f"result too large in {text} (at most {self.max_magnitude:g})") from None

    def _walk(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, not complex
            return self._bounded(cast("int | float", node.value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._walk(node.left), self._walk(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, complex):  # a negative base to a fractional power
                raise CalculatorError(f"no real value for {format_number(left)}**{format_number(right)}")
            return self._bounded(value)
        what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
        raise CalculatorError(f"only numbers, arithmetic operators and parentheses are allowed, not {what}")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > self.max_exponent:
            raise CalculatorError(f"exponent too large: {format_number(exponent)} (at most {self.max_exponent})")
        if base == 0 and exponent < 0:
            raise ZeroDivisionError
        # |base|**exponent would exceed the bound: refuse before computing it (a big int power is slow)
        if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(self.max_magnitude):
            raise OverflowError

    def _bounded(self, value: int | float) -> int | float:
        if isinstance(value, float) and not math.isfinite(value):
            raise OverflowError
        if abs(value) > self.max_magnitude:
            raise OverflowError
        return value


def format_number(value: int | float) -> str:
    """``20126`` for ints and integral floats, else up to 12 significant digits (``0.333333333333``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)
