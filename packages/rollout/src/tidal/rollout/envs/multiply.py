"""`multiply`: multi-digit multiplication that a tiny model can only get right with the calculator.

Prompt ``347*58=``; the answer is the product. With tools (the default) an episode allows `max_turns`
actions and the ``tags`` parser's ``<calc>`` tag; without (``tools=False``, the ceiling of the model on its
own) the first action is the answer. Prompts, calls, results and answers use only `TOOL_ALPHABET`.

The final answer is read from the first line of the last action, spaces trimmed, an optional
``Answer:`` before it (any case): it must be that integer exactly (``20126``, ``Answer: 20126``;
not ``20126.0``, not ``about 20126``). Reward 1 for the product, else 0.

The plain rendering (what the rollout worker's ``plain`` renderer makes of an episode, and what
`demonstration` writes): the user message's content, then each action as sampled, each followed by the
content of every tool message it got back and a newline::

    347*58=<calc>347*58</calc><result>20126</result>
    20126

i.e. ``"347*58="`` (environment), ``"<calc>347*58</calc>"`` (model; the engine stops at ``</calc>``),
``"<result>20126</result>\\n"`` (environment), ``"20126"`` (model, then end of sequence).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

from tidal.core.interfaces import Task
from tidal.core.toolenv import ToolEnvironment
from tidal.core.toolparsers import TagParser
from tidal.rollout.envs.tasks import _stream
from tidal.rollout.tools.calculator import Calculator

TAGS = {"calc": ["calculator", "expression"]}  # the one tag of the task
SEPARATOR = "\n"  # what the plain renderer writes after each tool message
_ANSWER = re.compile(r"(?:answer:\s*)?(-?\d+)", re.IGNORECASE)


class Multiply(ToolEnvironment):
    """`digits` = (digits of a, digits of b); 3 x 2 by default (``347*58=``)."""

    domain = "multiply"

    def __init__(self, digits: tuple[int, int] = (3, 2), tools: bool = True, max_turns: int = 3,
                 valid_call_reward: float = 0.0, eval_size: int = 200,
                 calculator: dict[str, Any] | None = None) -> None:
        if len(digits) != 2 or not all(1 <= d <= 9 for d in digits):
            raise ValueError(f"digits is (digits of a, digits of b), each 1..9, got {digits!r}")
        # `calculator`: the calculator tool's options (`tidal plugins tool`), e.g. {max_length = 40}
        super().__init__(tools={"calculator": dict(calculator or {})} if tools else {}, parser="tags",
                         parser_options={"tags": TAGS},
                         max_turns=max_turns if tools else 1, valid_call_reward=valid_call_reward)
        self.digits, self.with_tools, self.eval_size = tuple(digits), tools, eval_size

    def _make(self, rng: random.Random) -> Task:
        a, b = (rng.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1) for d in self.digits)
        return Task(prompt=f"{a}*{b}=", answer=str(a * b), domain=self.domain, metadata={"a": str(a), "b": str(b)})

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        return _stream(self._make, split, seed, self.eval_size)

    def verify(self, task: Task, final_text: str) -> float:
        return 1.0 if read_answer(final_text) == task.answer else 0.0


def read_answer(text: str) -> str | None:
    """The integer a final answer gives (see the module docstring), as text; None when it gives none."""
    m = _ANSWER.fullmatch(text.split("\n", 1)[0].strip())
    return str(int(m.group(1))) if m else None


def demonstration(task: Task, rng: random.Random, tool_rate: float = 0.5) -> list[tuple[str, bool]]:
    """A conversation for warm-start SFT as (text, written by the model) segments, byte for byte the
    plain rendering of a `Multiply` episode (module docstring). With probability `tool_rate` the model
    calls the calculator and copies its result; otherwise it answers at once with a plausible wrong
    guess (the digits of the product with one changed), which RL then learns to stop doing."""
    segments = [(task.prompt, False)]
    if rng.random() < tool_rate:
        parser = TagParser(TAGS)
        call = f"<calc>{task.prompt.removesuffix('=')}</calc>"
        (parsed,) = parser.parse(call)
        result = Calculator().run(parsed.arguments)
        segments += [(call, True), (parser.format_result(parsed, result) + SEPARATOR, False), (result.content, True)]
    else:
        segments.append((wrong_guess(task.answer, rng), True))
    return segments


def wrong_guess(answer: str, rng: random.Random) -> str:
    """`answer` with one digit changed (never a leading zero): right length, wrong value."""
    digits = list(answer)
    at = rng.choice([i for i, c in enumerate(digits) if c.isdigit()])
    lowest = 1 if at == answer.startswith("-") and len(digits) > at + 1 else 0
    digits[at] = rng.choice([d for d in "0123456789"[lowest:] if d != digits[at]])
    return "".join(digits)
