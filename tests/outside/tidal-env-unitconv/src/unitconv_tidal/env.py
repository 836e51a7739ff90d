"""Unit conversion, in turns.

The model is asked to convert a quantity ("Convert 3 km to m."). After each answer the environment looks
the factor up with its `unit_factor` tool (a plugin, built through Tidal's registry by name) and shows
the lookup as a tool message; an answer holding the right number ends the episode with outcome 1.0,
otherwise the model tries again until `max_turns`, and the outcome is 0.0.

A wrong answer earns partial credit (a quarter of the share of the answer's digits the actions wrote), so
that even an untrained model's groups differ in reward and train.

Options switch on the mistakes an author makes: `outcome_fault` ("nan", "none", "string", "str_number":
what `outcome()` returns instead of a number; "mixed": each episode one of them), `step_error_every` (every n-th episode's step raises),
and the `unit_factor` tool options (`tools`), which make it hang or flood.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Iterator
from typing import Any

from tidal.core.episodes import AGENT, Observation, StepResult
from tidal.core.interfaces import Task
from tidal.core.plugins import registry
from tidal.core.protocol import ChatMessage
from unitconv_tidal.tools import FACTORS

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FAULTS = {"": None, "nan": float("nan"), "none": None, "string": "wrong", "str_number": "1.0", "mixed": None}
_MIXED = (float("nan"), None, "wrong", "1.0")  # "mixed": each episode one of these, by its prompt


class UnitConv:
    def __init__(self, max_turns: int = 3, outcome_fault: str = "", step_error_every: int = 0,
                 tools: dict[str, dict[str, Any]] | None = None) -> None:
        if outcome_fault not in _FAULTS:
            raise ValueError(f"outcome_fault must be one of {sorted(_FAULTS)}, got {outcome_fault!r}")
        self.max_turns, self.outcome_fault, self.step_error_every = max_turns, outcome_fault, step_error_every
        options = {"unit_factor": {}, "unit_round": {}, **(tools or {})}
        self.tools = {name: registry.build("tool", name, opts, field=f"tools.{name}") for name, opts in options.items()}

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        rng = random.Random(f"{split}-{seed}")
        pairs = sorted(FACTORS)
        while True:
            a, b = rng.choice(pairs)
            n = rng.randint(1, 9)
            yield Task(prompt=f"Convert {n} {a} to {b}. Answer with the number.", answer=f"{n * FACTORS[(a, b)]:g}",
                       domain="unitconv", metadata={"from": a, "to": b})

    def episode(self, task: Task) -> UnitEpisode:
        return UnitEpisode(self, task)


class UnitEpisode:
    roles = (AGENT,)
    stop = ()

    def __init__(self, env: UnitConv, task: Task) -> None:
        self.env, self.task = env, task
        self.tools = tuple(t.spec for t in env.tools.values())
        self.solved = False
        self.written = ""  # every action so far: partial credit for the answer's digits among them
        self.index = zlib.crc32(task.prompt.encode())

    def reset(self) -> Observation:
        return Observation(messages=[ChatMessage(role="user", content=self.task.prompt)])

    def step(self, action: str, role: str = AGENT) -> StepResult:
        if self.env.step_error_every and self.index % self.env.step_error_every == 0:
            raise KeyError(f"no handler for the action {action[:20]!r}")  # the author's bug
        units = {"from": self.task.metadata.get("from", ""), "to": self.task.metadata.get("to", "")}
        lookup = self.env.tools["unit_factor"].run(units)  # the author's tool, run inside the episode
        self.solved = self.task.answer in _NUMBER.findall(action)
        self.written += action
        note = ChatMessage(role="tool", name="unit_factor", content=f"{units['from']} -> {units['to']}: {lookup.content}")
        return StepResult(observation=Observation(messages=[note]), reward=0.0, done=self.solved,
                          info={"tool_calls": 1.0})

    def outcome(self) -> Any:
        if self.env.outcome_fault == "mixed":
            return _MIXED[self.index % len(_MIXED)]
        if self.env.outcome_fault:
            return _FAULTS[self.env.outcome_fault]
        digits = set(self.task.answer) - {"."}
        return 1.0 if self.solved else 0.25 * len(digits & set(self.written)) / len(digits)
