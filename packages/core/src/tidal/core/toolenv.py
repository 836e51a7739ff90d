"""`ToolEnvironment`: a reusable base for episodes in which the model may call tools before it answers.

A subclass poses tasks (`tasks`) and checks final answers (`verify`); the base does the rest. Each
episode shows the task as a user message (`prompt`); every action is parsed by the configured tool-call
parser (plugin kind ``tool_parser``, built by name through the registry, or a parser object such as
`tidal.core.toolparsers.JsonParser`), each call runs with the tool of that name (plugin kind ``tool``, or
a tool object an episode brings: `ToolEpisode(env, task, tools=[...])`) and comes back as a ``tool``
message whose content is the parser's `format_result`. An action without a call is the final answer
(done; an episode whose other actions are moves of a game overrides `ToolEpisode.answer`); so is the
action that reaches `max_turns`, whatever it holds (its calls are not run: nobody would read the
results). `outcome()` is ``verify(task, final_text)``; a verifier that raises propagates, for the caller
to count as an error.

Only tidal-core is needed: a package outside Tidal subclasses it without tidal-rollout (engines, torch);
see examples/tidal-env-guess.

Step counters (`StepResult.info`): ``tool_calls`` (calls parsed), ``tool_errors`` (results with an error,
unknown tools included), ``invalid_calls`` (a call the parser could not read, or one naming no tool),
``tool_seconds``; ``unanswered_calls`` on the last turn. A step whose calls all succeeded earns
`valid_call_reward` (default 0: only the outcome counts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from tidal.core.episodes import AGENT, Observation, StepResult, Tool, ToolCall, ToolParser, ToolResult
from tidal.core.interfaces import Task
from tidal.core.plugins import registry
from tidal.core.protocol import ChatMessage, ToolSpec


class ToolEnvironment(ABC):
    """An `EpisodicEnvironment` whose episodes may call `tools` ({plugin name: options}) through the
    `parser` plugin (with `parser_options`)."""

    def __init__(self, *, tools: dict[str, dict[str, Any]] | None = None, parser: str | ToolParser = "tags",
                 parser_options: dict[str, Any] | None = None, max_turns: int = 4,
                 valid_call_reward: float = 0.0) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns is the number of actions an episode allows, at least 1, got {max_turns}")
        self.max_turns = max_turns
        self.valid_call_reward = valid_call_reward
        if isinstance(parser, str):
            self.parser: ToolParser = registry.build("tool_parser", parser, parser_options or {}, field="parser")
        elif parser_options:
            raise ValueError(f"parser_options {parser_options!r} are for a parser named by its plugin name; "
                             f"the parser given is already built ({type(parser).__name__})")
        else:
            self.parser = parser
        self.tools: dict[str, Tool] = {}  # by the name the model calls (the spec's), not the plugin's
        for name, options in (tools or {}).items():
            tool = registry.build("tool", name, options, field=f"tools.{name}")
            self.tools[tool.spec.name] = tool

    @abstractmethod
    def tasks(self, split: str, seed: int) -> Iterator[Task]: ...

    def verify(self, task: Task, final_text: str) -> float:
        """The reward of the episode's final text (raises when it cannot tell)."""
        raise NotImplementedError(f"{type(self).__name__} scores final answers: implement verify(task, final_text), "
                                  f"or override ToolEpisode.outcome for an episode scored otherwise")

    def prompt(self, task: Task) -> str:
        """The user message that opens an episode."""
        return task.prompt

    def episode(self, task: Task) -> ToolEpisode:
        return ToolEpisode(self, task)


class ToolEpisode:
    """One attempt at one task of a `ToolEnvironment` (single use)."""

    roles = (AGENT,)

    def __init__(self, env: ToolEnvironment, task: Task, tools: Sequence[Tool] = ()) -> None:
        self.env, self.task = env, task
        # the environment's tools, and any this episode brings (a tool holding the episode's state)
        self.by_name: dict[str, Tool] = {**env.tools, **{tool.spec.name: tool for tool in tools}}
        self.tools: list[ToolSpec] = [tool.spec for tool in self.by_name.values()]
        self.stop: list[str] = list(env.parser.stop) if self.by_name else []  # a turn ends on a call's closing tag
        self.turns = 0
        self.done = False
        self.final_text: str | None = None

    def reset(self) -> Observation:
        return Observation(messages=[ChatMessage(role="user", content=self.env.prompt(self.task))])

    def step(self, action: str, role: str = AGENT) -> StepResult:
        if self.done:
            raise RuntimeError(f"step() after the episode is done (turn {self.turns} of {self.env.max_turns})")
        if role != AGENT:
            raise ValueError(f"a tool episode has one role, {AGENT!r}, not {role!r}")
        self.turns += 1
        last = self.turns >= self.env.max_turns
        try:
            calls = self.env.parser.parse(action)
        except ValueError as e:  # a call the parser recognised but could not read: the model is told
            if last:
                return self._finish(action, {"tool_calls": 0.0, "tool_errors": 0.0, "invalid_calls": 1.0})
            unreadable = ToolCall(name="", raw=action)
            shown = self.env.parser.format_result(unreadable, ToolResult(content=str(e), error="invalid_call"))
            return StepResult(observation=Observation(messages=[ChatMessage(role="tool", content=shown)]),
                              info={"tool_calls": 0.0, "tool_errors": 0.0, "invalid_calls": 1.0})
        if not calls:
            return self.answer(action)
        if last:
            return self._finish(action, {"tool_calls": 0.0, "tool_errors": 0.0, "invalid_calls": 0.0,
                                         "unanswered_calls": float(len(calls))})
        messages, errors, invalid, seconds = [], 0, 0, 0.0
        for call in calls:
            tool = self.by_name.get(call.name)
            if tool is None:
                known = ", ".join(self.by_name) or "none"
                result = ToolResult(content=f"no tool named {call.name}; the tools are: {known}", error="unknown_tool")
                invalid += 1
            else:
                result = tool.run(call.arguments)  # a tool that raises is a bug of the tool: it propagates
            errors += bool(result.error)
            seconds += result.elapsed_s
            messages.append(ChatMessage(role="tool", name=call.name, content=self.env.parser.format_result(call, result)))
        return StepResult(observation=Observation(messages=messages),
                          reward=self.env.valid_call_reward if errors == 0 else 0.0,
                          info={"tool_calls": float(len(calls)), "tool_errors": float(errors),
                                "invalid_calls": float(invalid), "tool_seconds": seconds})

    def answer(self, action: str) -> StepResult:
        """An action without a tool call: the final answer (done; `outcome()` verifies it). An episode
        whose actions without a call are moves (a guess the environment answers) overrides this."""
        return self._finish(action, {"tool_calls": 0.0, "tool_errors": 0.0, "invalid_calls": 0.0})

    def _finish(self, action: str, info: dict[str, float]) -> StepResult:
        self.done, self.final_text = True, action
        return StepResult(done=True, info=info)

    def outcome(self) -> float:
        if not self.done or self.final_text is None:
            raise RuntimeError(f"outcome() before the episode is done (turn {self.turns} of {self.env.max_turns})")
        return float(self.env.verify(self.task, self.final_text))
