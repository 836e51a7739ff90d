"""Guess the number, in turns.

The model is told the range and guesses; the environment answers "Higher." or "Lower." until the
guess is right or the turns run out. Each guess that comes closer than any before earns a small step
reward (`step_reward` times the share of the range it closed); the outcome is 1.0 when the number was
found, else 0.0. The model may call the ``hint`` tool (declared with a `ToolSpec`, run by the
environment itself) once per episode to learn whether the number is even or odd::

    <tool_call>{"name": "hint", "arguments": {}}</tool_call>

The episode implements tidal-core's `Episode` protocol; nothing here imports tidal-rollout.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterator

from tidal.core.episodes import AGENT, Observation, StepResult
from tidal.core.interfaces import Task
from tidal.core.protocol import ChatMessage, ToolSpec

HINT = ToolSpec(
    name="hint",
    description="Says whether the secret number is even or odd. Usable once per game.",
    parameters={"type": "object", "properties": {}},
)
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_NUMBER = re.compile(r"-?\d+")


def _user(text: str) -> Observation:
    return Observation(messages=[ChatMessage(role="user", content=text)])


class GuessEpisode:
    """One game: single use, stepped by one driver."""

    tools = (HINT,)
    roles = (AGENT,)
    stop = ("</tool_call>",)  # a turn that calls the hint tool ends on its closing tag

    def __init__(self, task: Task, low: int, high: int, step_reward: float) -> None:
        self.task, self.low, self.high, self.step_reward = task, low, high, step_reward
        self.secret = int(task.answer)
        if not low <= self.secret <= high:
            raise ValueError(f"the task's answer {self.secret} is outside [{low}, {high}]")
        self.best = high - low + 1  # distance of the closest guess so far
        self.guesses = 0  # readable guesses (the number of tries a found number took)
        self.moves = 0  # every step, unreadable ones included: a game whose moves never guessed is lost
        self.hinted = self.found = False

    def reset(self) -> Observation:
        return _user(self.task.prompt or prompt(self.low, self.high))

    def step(self, action: str, role: str = AGENT) -> StepResult:
        self.moves += 1
        call = _CALL.search(action)
        if call is not None:
            return self._tool(call.group(1))
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
            self.found = True
            return StepResult(reward=reward, done=True, info={"guesses": float(self.guesses)})
        return StepResult(reward=reward, observation=_user("Higher." if guess < self.secret else "Lower."))

    def _tool(self, body: str) -> StepResult:
        try:
            call = json.loads(body)
            name = call["name"]
        except (ValueError, KeyError, TypeError) as e:
            return self._tool_answer("hint", f"error: cannot read the tool call ({e}); write "
                                             f'<tool_call>{{"name": "hint", "arguments": {{}}}}</tool_call>',
                                     {"invalid_calls": 1.0})
        if name != HINT.name:
            return self._tool_answer(str(name), f"error: there is no tool {name!r}; the only tool is hint",
                                     {"invalid_calls": 1.0})
        if self.hinted:
            return self._tool_answer("hint", "error: the hint was already used", {"tool_calls": 1.0, "tool_errors": 1.0})
        self.hinted = True
        return self._tool_answer("hint", f"The number is {'even' if self.secret % 2 == 0 else 'odd'}.",
                                 {"tool_calls": 1.0})

    @staticmethod
    def _tool_answer(name: str, content: str, info: dict[str, float]) -> StepResult:
        return StepResult(observation=Observation(messages=[ChatMessage(role="tool", name=name, content=content)]),
                          info=info)

    def outcome(self) -> float:
        if self.moves == 0:
            raise RuntimeError("outcome() of a game without a single move")
        return 1.0 if self.found else 0.0


def prompt(low: int, high: int) -> str:
    return (f"I am thinking of an integer from {low} to {high}. Guess it: answer with one number, and I will say "
            f"higher or lower. You may call the hint tool once: "
            f'<tool_call>{{"name": "hint", "arguments": {{}}}}</tool_call>')


class GuessNumber:
    """The environment (`tidal.core.episodes.EpisodicEnvironment`): tasks, and an episode per sample.

    `max_turns` defaults to what bisection needs plus one for the hint and one to spare. Held-out
    (eval) games draw their numbers from a stream of their own, `eval_size` of them per seed.
    """

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 0, step_reward: float = 0.1,
                 eval_size: int = 50) -> None:
        if high <= low:
            raise ValueError(f"need low < high, got [{low}, {high}]")
        self.low, self.high, self.step_reward, self.eval_size = low, high, step_reward, eval_size
        self.max_turns = max_turns or math.ceil(math.log2(high - low + 1)) + 2

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        rng = random.Random(f"{split}-{seed}")
        count = 0
        while split == "train" or count < self.eval_size:
            count += 1
            yield Task(prompt=prompt(self.low, self.high), answer=str(rng.randint(self.low, self.high)),
                       domain="guess_number", metadata={"low": str(self.low), "high": str(self.high)})

    def episode(self, task: Task) -> GuessEpisode:
        return GuessEpisode(task, self.low, self.high, self.step_reward)
