"""The tool-using environment base in tidal-core: built with parser and tool objects (no plugin of
tidal-rollout needed), calls read and answered, an action without a call the final answer unless the
episode makes it a move, and tools an episode brings of its own."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from tidal.core.episodes import Episode, StepResult, ToolResult, is_episodic
from tidal.core.interfaces import Task
from tidal.core.protocol import ToolSpec
from tidal.core.toolenv import ToolEnvironment, ToolEpisode
from tidal.core.toolparsers import JsonParser

CALL = '<tool_call>{"name": "count", "arguments": {}}</tool_call>'


class Counter:
    """A tool with state: how many times it was called in its episode."""

    spec = ToolSpec(name="count", description="how many calls so far", parameters={"type": "object"})

    def __init__(self) -> None:
        self.calls = 0

    def run(self, arguments: Mapping[str, Any]) -> ToolResult:
        self.calls += 1
        return ToolResult(content=str(self.calls))


class Echo(ToolEnvironment):
    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        yield Task(prompt="say 3", answer="3")

    def verify(self, task: Task, final_text: str) -> float:
        return float(final_text.strip() == task.answer)

    def episode(self, task: Task) -> ToolEpisode:
        return ToolEpisode(self, task, tools=[Counter()])


class Moves(ToolEpisode):
    """Actions without a call are moves; the episode ends on "stop"."""

    def answer(self, action: str) -> StepResult:
        if action == "stop":
            self.done = True
            return StepResult(done=True)
        return StepResult(info={"moves": 1.0})

    def outcome(self) -> float:
        return float(self.turns)


def test_a_parser_object_and_an_episodes_own_tool_answer_calls_then_the_final_answer_is_verified() -> None:
    env = Echo(parser=JsonParser(stop_after_call=True), max_turns=4)
    assert is_episodic(env)
    ep = env.episode(next(env.tasks("train", 0)))
    assert isinstance(ep, Episode) and [t.name for t in ep.tools] == ["count"] and ep.stop == ["</tool_call>"]
    assert ep.reset().messages[0].content == "say 3"
    first, second = ep.step(CALL), ep.step(CALL)
    assert [first.observation.messages[0].content, second.observation.messages[0].content] == ["1", "2"]
    assert second.info["tool_calls"] == 1.0 and second.info["tool_errors"] == 0.0 and not second.done
    assert env.episode(next(env.tasks("train", 0))).by_name["count"] is not ep.by_name["count"]
    final = ep.step("3")
    assert final.done and ep.outcome() == 1.0


def test_an_episode_that_overrides_answer_plays_moves_until_it_says_done() -> None:
    env = Echo(parser=JsonParser(), max_turns=5)
    ep = Moves(env, Task(prompt="p", answer=""))
    assert ep.step("left").info == {"moves": 1.0} and not ep.step(CALL).done
    assert ep.step("stop").done and ep.outcome() == 3.0


def test_options_for_a_parser_already_built_are_refused_and_verify_must_be_written_to_score_answers() -> None:
    with pytest.raises(ValueError, match="parser_options"):
        Echo(parser=JsonParser(), parser_options={"stop_after_call": True})

    class NoVerify(ToolEnvironment):
        def tasks(self, split: str, seed: int) -> Iterator[Task]:
            yield Task(prompt="p", answer="a")

    ep = NoVerify(parser=JsonParser()).episode(Task(prompt="p", answer="a"))
    assert ep.step("a").done
    with pytest.raises(NotImplementedError, match="verify"):
        ep.outcome()
