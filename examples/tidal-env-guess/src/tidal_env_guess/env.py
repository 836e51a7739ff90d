"""Guess the number, in turns.

The model is told the range and guesses; the environment answers "Higher." or "Lower." until the
guess is right or the turns run out. Each guess that comes closer than any before earns a small step
reward (`step_reward` times the share of the range it closed); the outcome is 1.0 when the number was
found, else 0.0. The model may call the ``hint`` tool (a `Tool` of the episode's own, declared with a
`ToolSpec`) once per episode to learn whether the number is even or odd::

    <tool_call>{"name": "hint", "arguments": {}}</tool_call>

Tool calls are read and answered by tidal-core's `ToolEnvironment` base (`tidal.core.toolenv`, with the
``json`` parser of `tidal.core.toolparsers`); this module adds the game: an action without a call is a
guess (`GuessEpisode.answer`). Nothing here imports tidal-rollout.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator, Mapping
from typing import Any

from tidal.core.episodes import Observation, StepResult, ToolResult
from tidal.core.interfaces import Task
from tidal.core.protocol import ChatMessage, ToolSpec
from tidal.core.toolenv import ToolEnvironment, ToolEpisode
from tidal.core.toolparsers import JsonParser

HINT = ToolSpec(
    name="hint",
    description="Says whether the secret number is even or odd. Usable once per game.",
    parameters={"type": "object", "properties": {}},
)
_NUMBER = re.compile(r"-?\d+")


def _user(text: str) -> Observation:
    return Observation(messages=[ChatMessage(role="user", content=text)])


class Hint:
    """The ``hint`` tool of one game: the parity of its secret, once."""

    spec = HINT

    def __init__(self, secret: int) -> None:
        self.secret, self.used = secret, False

    def run(self, arguments: Mapping[str, Any]) -> ToolResult:
        if self.used:
            return ToolResult(content="the hint was already used", error="used")
        self.used = True
        return ToolResult(content=f"The number is {'even' if self.secret % 2 == 0 else 'odd'}.")


class GuessEpisode(ToolEpisode):
    """One game: single use, stepped by one driver. The base answers tool calls; `answer` plays a guess."""

    env: GuessNumber

    def __init__(self, env: GuessNumber, task: Task) -> None:
        self.low, self.high, self.step_reward = env.low, env.high, env.step_reward
        self.secret = int(task.answer)
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"the task's answer {self.secret} is outside [{self.low}, {self.high}]")
        super().__init__(env, task, tools=[Hint(self.secret)])
        self.best = self.high - self.low + 1  # distance of the closest guess so far
        self.guesses = 0  # readable guesses (the number of tries a found number took)
        self.found = False

    def answer(self, action: str) -> StepResult:
        numbers = _NUMBER.findall(action)
        if not numbers:
            return StepResult(observation=_user(f"Answer with one integer from {self.low} to {self.high}."),
                              info={"invalid_guesses": 1.0})
        guess = int(numbers[0])
        self.guesses += 1
        if not self.low <= guess <= self.high:
            return StepResult(observation=_user(f"{guess} is outside {self.low}..{self.high}."),
                              info={"out_of_range": 1.0})
        distance = abs(guess - self.secret)
        reward = 0.0
        if distance < self.best:
            reward = self.step_reward * (self.best - distance) / (self.high - self.low + 1)
            self.best = distance
        if distance == 0:
            self.found = self.done = True
            return StepResult(reward=reward, done=True, info={"guesses": float(self.guesses)})
        return StepResult(reward=reward, observation=_user("Higher." if guess < self.secret else "Lower."))

    def outcome(self) -> float:
        # every step counts as a move (`turns`), unreadable ones included: a game never played has no outcome
        if self.turns == 0:
            raise RuntimeError("outcome() of a game without a single move")
        return 1.0 if self.found else 0.0


def prompt(low: int, high: int) -> str:
    return (f"I am thinking of an integer from {low} to {high}. Guess it: answer with one number, and I will say "
            f"higher or lower. You may call the hint tool once: "
            f'<tool_call>{{"name": "hint", "arguments": {{}}}}</tool_call>')


class GuessNumber(ToolEnvironment):
    """The environment (`tidal.core.episodes.EpisodicEnvironment`): tasks, and an episode per sample.

    `max_turns` defaults to what bisection needs plus one for the hint and one to spare. Held-out
    (eval) games draw their numbers from a stream of their own, `eval_size` of them per seed.
    """

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 0, step_reward: float = 0.1,
                 eval_size: int = 50) -> None:
        if high <= low:
            raise ValueError(f"need low < high, got [{low}, {high}]")
        self.low, self.high, self.step_reward, self.eval_size = low, high, step_reward, eval_size
        # a turn that calls the hint tool ends on its closing tag
        super().__init__(parser=JsonParser(stop_after_call=True),
                         max_turns=max_turns or math.ceil(math.log2(high - low + 1)) + 2)

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        rng = random.Random(f"{split}-{seed}")
        count = 0
        while split == "train" or count < self.eval_size:
            count += 1
            yield Task(prompt=prompt(self.low, self.high), answer=str(rng.randint(self.low, self.high)),
                       domain="guess_number", metadata={"low": str(self.low), "high": str(self.high)})

    def prompt(self, task: Task) -> str:
        return task.prompt or prompt(self.low, self.high)

    def episode(self, task: Task) -> GuessEpisode:
        return GuessEpisode(self, task)
