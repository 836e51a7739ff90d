"""Environments for the environment-pool tests, registered in the environment processes by module name
(``EnvPool(plugins=["envpool_plugins"])`` with this folder on PYTHONPATH).

- ``counting``: multi-turn; the model must say 1, 2, ... `turns` in turn; step reward 1 per right number,
  outcome the fraction right; each step takes `delay_s`. Its first observation names the pid serving it
  (for kill drills).
- ``sleepy``: its step never returns (the pool's timeout), stuck in `wait_for_a_lookup_that_never_returns`.
- ``sleepy_open``: its reset never returns (the same function).
- ``slow_build``: its factory never returns (stuck in `load_a_dataset_forever`): the process never says Hello.
- ``raising_build``: its factory raises (a missing data file).
- ``flooding``: `reset_chars` characters in its first observation, `step_chars` in each step's (a tool dump).
- ``bad_reward``: done after one step; its step reward and `outcome()` are what `step_reward` and
  `outcome` name in `_VALUES` (a string, None, NaN, ...).
- ``bad_score``: a single-turn env whose `score` returns the string "1.0".
- ``raising_step``: its step raises.
- ``raising_verifier``: done after one step, then `outcome()` raises.
- ``dies_on_open``: the process exits as an episode starts (a crash loop).
- ``duel``: two roles, "a" and "b", alternately `moves` turns each, any text accepted; "a" wins (+1, "b"
  -1) when its actions hold more characters in all. A role named in the task's ``tidal.scripted`` is played
  by the environment (it answers "x"); every action each role took is kept by role (`DuelEpisode.log`).
  `name_roles=False`: its observations forget to say whose turn it is (an author's mistake).
- ``flaky``: done after one step; the episodes this env object makes are numbered as opened, and those
  numbered in `fail` have an `outcome()` that raises (the author's text names the episode number).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator

from tidal.core.episodes import AGENT, SCRIPTED_KEY, Observation, StepResult
from tidal.core.interfaces import Task
from tidal.core.plugins import hookimpl
from tidal.core.protocol import ChatMessage, ToolSpec


def _user(text: str) -> Observation:
    return Observation(messages=[ChatMessage(role="user", content=text)])


class _Episode:
    roles = (AGENT,)
    tools: tuple[ToolSpec, ...] = ()
    stop: tuple[str, ...] = ()

    def __init__(self, task: Task) -> None:
        self.task = task

    def reset(self) -> Observation:
        return _user(self.task.prompt)

    def outcome(self) -> float:
        return 0.0


class CountingEpisode(_Episode):
    tools = (ToolSpec(name="say", description="say a number", parameters={"type": "object", "properties": {}}),)

    def __init__(self, task: Task, turns: int, delay_s: float) -> None:
        super().__init__(task)
        self.turns, self.delay_s, self.turn, self.right = turns, delay_s, 0, 0

    def reset(self) -> Observation:
        return _user(f"{self.task.prompt}: count from 1 to {self.turns} (served by pid {os.getpid()})")

    def step(self, action: str, role: str = AGENT) -> StepResult:
        time.sleep(self.delay_s)
        self.turn += 1
        ok = action.strip() == str(self.turn)
        self.right += ok
        done = self.turn == self.turns
        return StepResult(reward=float(ok), done=done, info={"right": float(ok)},
                          observation=None if done else _user(f"said {action.strip()}; next"))

    def outcome(self) -> float:
        return self.right / self.turns


class _Env:
    max_turns = 10

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        return (Task(prompt=f"task {i}", domain=type(self).__name__) for i in itertools.count(seed))


class Counting(_Env):
    def __init__(self, turns: int = 3, delay_s: float = 0.0, max_turns: int = 10) -> None:
        self.turns, self.delay_s, self.max_turns = turns, delay_s, max_turns

    def episode(self, task: Task) -> CountingEpisode:
        return CountingEpisode(task, self.turns, self.delay_s)


def wait_for_a_lookup_that_never_returns() -> None:
    time.sleep(3600)


def load_a_dataset_forever() -> None:
    time.sleep(3600)


class SleepyEpisode(_Episode):
    def step(self, action: str, role: str = AGENT) -> StepResult:
        wait_for_a_lookup_that_never_returns()
        return StepResult(done=True)


class SleepyOpenEpisode(_Episode):
    def reset(self) -> Observation:
        wait_for_a_lookup_that_never_returns()
        return _user("never")


class SlowBuild(_Env):
    def __init__(self) -> None:
        load_a_dataset_forever()


class RaisingBuild(_Env):
    def __init__(self) -> None:
        raise FileNotFoundError("tasks.jsonl is not in the package")


class FloodingEpisode(_Episode):
    def __init__(self, task: Task, reset_chars: int, step_chars: int) -> None:
        super().__init__(task)
        self.reset_chars, self.step_chars = reset_chars, step_chars

    def reset(self) -> Observation:
        return _user("r" * self.reset_chars)

    def step(self, action: str, role: str = AGENT) -> StepResult:
        dump = ChatMessage(role="tool", name="lookup", content="x" * self.step_chars)
        return StepResult(observation=Observation(messages=[dump, ChatMessage(role="user", content="and?")]))


class Flooding(_Env):
    def __init__(self, reset_chars: int = 10, step_chars: int = 5 * 1024 * 1024) -> None:
        self.reset_chars, self.step_chars = reset_chars, step_chars

    def episode(self, task: Task) -> FloodingEpisode:
        return FloodingEpisode(task, self.reset_chars, self.step_chars)


_VALUES = {"string": "wrong", "str_number": "1.0", "none": None, "nan": float("nan"), "inf": float("inf"),
           "one": 1, "true": True, "half": 0.5}


class BadRewardEpisode(_Episode):
    def __init__(self, task: Task, step_reward: str, outcome: str) -> None:
        super().__init__(task)
        self.step_reward, self.result = _VALUES[step_reward], _VALUES[outcome]

    def step(self, action: str, role: str = AGENT) -> StepResult:
        return StepResult(done=True, reward=self.step_reward)

    def outcome(self) -> float:
        return self.result


class BadReward(_Env):
    def __init__(self, step_reward: str = "half", outcome: str = "one") -> None:
        self.step_reward, self.outcome = step_reward, outcome

    def episode(self, task: Task) -> BadRewardEpisode:
        return BadRewardEpisode(task, self.step_reward, self.outcome)


class BadScore:
    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        return (Task(prompt=f"task {i}") for i in itertools.count(seed))

    def score(self, task: Task, completion: str) -> float:
        return "1.0"  # type: ignore[return-value]  # the author's bug: a parsed answer, not converted


class RaisingStepEpisode(_Episode):
    def step(self, action: str, role: str = AGENT) -> StepResult:
        raise ValueError(f"cannot parse action {action!r}")


class RaisingVerifierEpisode(_Episode):
    def step(self, action: str, role: str = AGENT) -> StepResult:
        return StepResult(done=True, reward=0.25)

    def outcome(self) -> float:
        raise RuntimeError("the judge is unreachable")


def _env_of(episode_type: type) -> type:
    return type(episode_type.__name__.replace("Episode", ""), (_Env,), {"episode": lambda self, task: episode_type(task)})


class FlakyEpisode(_Episode):
    def __init__(self, task: Task, number: int, fails: bool) -> None:
        super().__init__(task)
        self.number, self.fails = number, fails

    def step(self, action: str, role: str = AGENT) -> StepResult:
        return StepResult(done=True)

    def outcome(self) -> float:
        if self.fails:
            raise ValueError(f"flaky verifier: episode {self.number} cannot be judged")
        return 1.0


class Flaky(_Env):
    def __init__(self, fail: list[int] | None = None) -> None:
        self.fail, self.opened = set(fail or []), 0

    def episode(self, task: Task) -> FlakyEpisode:
        self.opened += 1
        return FlakyEpisode(task, self.opened - 1, self.opened - 1 in self.fail)


class DuelEpisode(_Episode):
    roles = ("a", "b")

    def __init__(self, task: Task, moves: int, name_roles: bool = True) -> None:
        super().__init__(task)
        self.moves, self.turn, self.name_roles = moves, 0, name_roles
        self.scripted = {r for r in task.metadata.get(SCRIPTED_KEY, "").split(",") if r}
        self.log: dict[str, list[str]] = {"a": [], "b": []}

    def _next(self) -> Observation | None:
        """Play scripted turns, then the observation of the role to move (None: the duel is over)."""
        while self.turn < 2 * self.moves:
            role = self.roles[self.turn % 2]
            if role not in self.scripted:
                return Observation(text=f"{self.task.prompt} {role} {self.turn}:", role=role if self.name_roles else "")
            self.log[role].append("x")
            self.turn += 1
        return None

    def reset(self) -> Observation:
        obs = self._next()
        assert obs is not None
        return obs

    def step(self, action: str, role: str = AGENT) -> StepResult:
        expected = self.roles[self.turn % 2]
        if role != expected:
            raise ValueError(f"role {role!r} moved on {expected!r}'s turn")
        self.log[role].append(action)
        self.turn += 1
        obs = self._next()
        return StepResult(observation=obs, done=obs is None)

    def outcome(self) -> dict[str, float]:
        a, b = (sum(map(len, self.log[r])) for r in self.roles)
        return {"a": 1.0 if a > b else -1.0, "b": -1.0 if a > b else 1.0}


class Duel(_Env):
    roles = ("a", "b")

    def __init__(self, moves: int = 2, name_roles: bool = True) -> None:
        self.moves, self.name_roles = moves, name_roles

    def episode(self, task: Task) -> DuelEpisode:
        return DuelEpisode(task, self.moves, self.name_roles)


class DiesOnOpen(_Env):
    def episode(self, task: Task) -> _Episode:
        os._exit(3)


@hookimpl
def tidal_envs():
    return {"counting": Counting, "sleepy": _env_of(SleepyEpisode), "raising_step": _env_of(RaisingStepEpisode),
            "raising_verifier": _env_of(RaisingVerifierEpisode), "dies_on_open": DiesOnOpen,
            "sleepy_open": _env_of(SleepyOpenEpisode), "slow_build": SlowBuild, "raising_build": RaisingBuild,
            "flooding": Flooding, "bad_reward": BadReward, "bad_score": BadScore, "flaky": Flaky, "duel": Duel}
