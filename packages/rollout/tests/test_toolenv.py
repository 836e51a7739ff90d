"""Tool episodes: the multiply environment stepped for real (calls, results, answers, errors, turn
limits), a verifier that raises, and the warm-start demonstrations matching the plain rendering byte for
byte."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from tidal.core.episodes import Episode, EpisodicEnvironment, Observation, StepResult, is_episodic
from tidal.core.errors import ConfigError
from tidal.core.interfaces import Task
from tidal.core.plugins import registry
from tidal.core.toolenv import ToolEnvironment
from tidal.rollout.envs.multiply import Multiply, demonstration, read_answer, wrong_guess
from tidal.rollout.envs.tasks import first_tasks
from tidal.rollout.tiny import TOOL_ALPHABET

TASK = Task(prompt="347*58=", answer="20126", domain="multiply")


def render_plain(first: Observation, turns: list[tuple[str, StepResult]]) -> str:
    """The plain renderer's text (multiply's docstring): the user content, then each action followed by
    the content of every tool message it got back and a newline."""
    text = "".join(m.content for m in first.messages)
    for action, step in turns:
        text += action
        if step.observation is not None:
            text += "".join(m.content + "\n" for m in step.observation.messages)
    return text


def test_multiply_is_an_episodic_env_plugin_with_checked_options() -> None:
    env = registry.build("env", "multiply", {"digits": [2, 2], "max_turns": 2})
    assert isinstance(env, EpisodicEnvironment) and is_episodic(env)
    assert env.digits == (2, 2) and env.max_turns == 2
    assert isinstance(env.episode(TASK), Episode)
    with pytest.raises(ConfigError, match="digit"):
        registry.build("env", "multiply", {"digit": [2, 2]})
    with pytest.raises(ConfigError, match="digits"):
        registry.build("env", "multiply", {"digits": [0, 2]})


def test_multiply_tasks_are_split_by_prompt_hash_in_the_tool_alphabet() -> None:
    env = Multiply()
    held_out = {t.prompt for t in first_tasks(env, "eval", seed=0, n=100)}
    train = list(itertools.islice(env.tasks("train", seed=0), 2000))
    assert len(held_out) == 100 and not held_out & {t.prompt for t in train}
    for t in train[:200]:
        a, b = t.prompt.removesuffix("=").split("*")
        assert len(a) == 3 and len(b) == 2 and t.answer == str(int(a) * int(b))
        assert set(t.prompt + t.answer) <= set(TOOL_ALPHABET)


def test_episode_calls_the_calculator_then_answers_for_reward_one() -> None:
    env = Multiply()
    episode = env.episode(TASK)
    first = episode.reset()
    assert [(m.role, m.content) for m in first.messages] == [("user", "347*58=")]
    assert [t.name for t in episode.tools] == ["calculator"] and env.parser.stop == ["</calc>"]
    step = episode.step("<calc>347*58</calc>")
    assert not step.done and step.reward == 0.0
    assert [(m.role, m.name, m.content) for m in step.observation.messages] == [("tool", "calculator", "<result>20126</result>")]
    assert (step.info["tool_calls"], step.info["tool_errors"], step.info["invalid_calls"]) == (1, 0, 0)
    final = episode.step("20126")
    assert final.done and final.observation is None and final.info["tool_calls"] == 0
    assert episode.outcome() == 1.0
    with pytest.raises(RuntimeError, match="after the episode is done"):
        episode.step("again")


def test_final_answers_are_read_leniently_but_exactly() -> None:
    assert [read_answer(t) for t in ("20126", " 20126 \nmore", "Answer: 20126", "answer:20126", "20126.0",
                                     "about 20126", "", "<calc>347*58</calc>")] == \
        ["20126", "20126", "20126", "20126", None, None, None, None]
    for text, reward in (("Answer: 20126", 1.0), ("20127", 0.0), ("020126", 1.0), ("20126.0", 0.0)):
        episode = Multiply().episode(TASK)
        episode.reset()
        assert episode.step(text).done and episode.outcome() == reward, text


def test_bad_and_unreadable_calls_are_error_observations_counted() -> None:
    episode = Multiply(max_turns=4, valid_call_reward=0.1).episode(TASK)
    episode.reset()
    bad = episode.step("<calc>347*</calc>")
    assert not bad.done and bad.reward == 0.0 and bad.info["tool_errors"] == 1 and bad.info["invalid_calls"] == 0
    assert bad.observation.messages[0].content == "<error>cannot read the expression 347*</error>"
    unclosed = episode.step("<calc>347*58")
    assert not unclosed.done and unclosed.info == {"tool_calls": 0, "tool_errors": 0, "invalid_calls": 1}
    assert unclosed.observation.messages[0].content == "<error><calc> opened but never closed: write <calc>...</calc></error>"
    good = episode.step("<calc>347*58</calc>")
    assert good.reward == 0.1 and set(good.observation.messages[0].content) <= set(TOOL_ALPHABET)
    assert episode.step("20126").done and episode.outcome() == 1.0


def test_max_turns_ends_the_episode_without_running_the_last_calls() -> None:
    episode = Multiply(max_turns=2).episode(TASK)
    episode.reset()
    assert not episode.step("<calc>1+1</calc>").done
    last = episode.step("<calc>347*58</calc>")
    assert last.done and last.observation is None and last.info["unanswered_calls"] == 1
    assert episode.outcome() == 0.0  # the last action gave no answer


def test_without_tools_the_first_action_is_the_answer() -> None:
    env = Multiply(tools=False)
    assert env.max_turns == 1 and env.tools == {}
    episode = env.episode(TASK)
    assert episode.tools == [] and episode.reset().messages[0].content == "347*58="
    assert episode.step("20126").done and episode.outcome() == 1.0
    episode = env.episode(TASK)
    episode.reset()
    assert episode.step("<calc>347*58</calc>").done and episode.outcome() == 0.0


class Echo(ToolEnvironment):
    """The JSON parser with the real python tool; the answer is checked by a verifier that may raise."""

    def __init__(self, **options) -> None:
        super().__init__(tools={"python": {"timeout_s": 5.0}, "calculator": {}}, parser="json", **options)

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        yield Task(prompt="print four", answer="4")

    def verify(self, task: Task, final_text: str) -> float:
        if final_text == "raise":
            raise RuntimeError("the verifier could not check this answer")
        return float(final_text.strip() == task.answer)


def test_unknown_tools_and_the_python_tool_through_the_json_parser() -> None:
    episode = Echo(max_turns=3).episode(Task(prompt="print four", answer="4"))
    assert {t.name for t in episode.tools} == {"python", "calculator"}
    step = episode.step('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
                        '<tool_call>{"name": "python", "arguments": {"code": "print(2+2)"}}</tool_call>')
    assert step.info["tool_calls"] == 2 and step.info["tool_errors"] == 1 and step.info["invalid_calls"] == 1
    unknown, ran = step.observation.messages
    assert unknown.name == "search" and unknown.content.startswith("error (unknown_tool): no tool named search")
    assert (ran.role, ran.name, ran.content) == ("tool", "python", "4\n")
    assert episode.step("4").done and episode.outcome() == 1.0


def test_a_verifier_that_raises_propagates() -> None:
    episode = Echo().episode(Task(prompt="print four", answer="4"))
    episode.reset()
    with pytest.raises(RuntimeError, match="before the episode is done"):
        episode.outcome()
    assert episode.step("raise").done
    with pytest.raises(RuntimeError, match="could not check"):
        episode.outcome()


class Plain(ToolEnvironment):
    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        yield TASK

    def verify(self, task: Task, final_text: str) -> float:
        return 0.0


def test_tool_environment_builds_its_plugins_with_checked_options() -> None:
    assert [t.name for t in Plain(tools={"calculator": {"max_exponent": 2}}).episode(TASK).tools] == ["calculator"]
    with pytest.raises(ConfigError, match="tool 'calculator': no option 'bound'"):
        Plain(tools={"calculator": {"bound": 1}})
    with pytest.raises(ConfigError, match="no tool named 'shell'"):
        Plain(tools={"shell": {}})
    with pytest.raises(ConfigError, match="no tool_parser named 'xml'"):
        Plain(parser="xml")
    with pytest.raises(ValueError, match="max_turns"):
        Plain(max_turns=0)


# --------------------------------------------------------------------------- demonstrations


def test_demonstration_is_the_rendered_episode_byte_for_byte() -> None:
    env, rng = Multiply(), random.Random(0)
    seen = set()
    for task in itertools.islice(env.tasks("train", seed=3), 60):
        segments = demonstration(task, rng)
        episode = env.episode(task)
        first = episode.reset()
        assert segments[0] == (first.messages[0].content, False)
        turns = []
        for text, by_model in segments[1:]:
            if by_model:
                turns.append((text, episode.step(text)))
        assert turns[-1][1].done
        assert render_plain(first, turns) == "".join(text for text, _ in segments)
        assert set("".join(text for text, _ in segments)) <= set(TOOL_ALPHABET)
        used_tool = len(segments) == 4
        assert episode.outcome() == (1.0 if used_tool else 0.0)  # the guess is always wrong
        seen.add(used_tool)
        if used_tool:
            assert [m for _, m in segments] == [False, True, False, True]
            assert segments[2] == (f"<result>{task.answer}</result>\n", False)
    assert seen == {True, False}


def test_demonstration_tool_rate_and_the_documented_example() -> None:
    rng = random.Random(1)
    assert demonstration(TASK, rng, tool_rate=1.0) == [
        ("347*58=", False), ("<calc>347*58</calc>", True), ("<result>20126</result>\n", False), ("20126", True)]
    direct = [demonstration(TASK, rng, tool_rate=0.0) for _ in range(50)]
    assert all(len(d) == 2 and d[1][1] for d in direct)
    guesses = {d[1][0] for d in direct}
    assert "20126" not in guesses and all(len(g) == 5 and g[0] != "0" for g in guesses) and len(guesses) > 5
    rates = [len(demonstration(TASK, rng, tool_rate=0.3)) == 4 for _ in range(2000)]
    assert 0.26 < sum(rates) / len(rates) < 0.34
    assert wrong_guess("0", rng) != "0"


def test_demonstration_text_round_trips_through_the_tiny_tool_tokenizer() -> None:
    from tidal.rollout.tiny import build_char_tokenizer

    tok = build_char_tokenizer(TOOL_ALPHABET)
    text = "".join(t for t, _ in demonstration(TASK, random.Random(0), tool_rate=1.0))
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.decode(ids) == text
