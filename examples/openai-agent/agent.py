"""A calculator agent written with the plain OpenAI Python client. It knows nothing of Tidal: any
OpenAI-compatible server drives it (OPENAI_BASE_URL, OPENAI_API_KEY), and `tidal run` trains the model
behind that server on it (README.md).

    python agent.py "347*58="

It offers the model one function, `calculator(expression)`, runs each call the model makes, gives the
result back as a `tool` message, and asks again, until the model answers without a call (at most
MAX_CALLS rounds). It prints the final answer.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

from openai import OpenAI

MAX_CALLS = 4
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The value of `expression`, or an error text for the model (never an exception)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        v = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(v)) if float(v).is_integer() else str(v)


def main() -> None:
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    model = os.environ.get("AGENT_MODEL", "policy")
    messages: list[dict] = [{"role": "user", "content": sys.argv[1]}]
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(message.content)
            return
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(messages[-1]["content"])


if __name__ == "__main__":
    main()
