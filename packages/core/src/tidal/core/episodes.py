"""Multi-turn episodes: what an agentic environment, a tool, a tool-call parser and a renderer offer.

An `EpisodicEnvironment` poses tasks like a single-turn `Environment` and hands out single-use
`Episode`s: ``reset()`` gives the first observation, ``step(action)`` answers each action the model
took with an observation, a step reward and whether the episode is done, and ``outcome()`` gives the
final (verified) reward. Episodes run in environment processes (tidal-rollout's pool), so they see text,
never tokens of the policy; tools (`Tool`) run wherever the episode calls them, outside the rollout
worker.

The rollout worker owns the token sequence. A `Renderer` turns the first observation into prompt
tokens and every later observation into the tokens that *extend* what was sampled, never re-rendering
the history; when it cannot extend exactly it says so (None) and the worker starts a new sample of the
same episode from a fresh render (counted as a split).

`SingleTurnEpisodes` adapts today's single-turn `Environment`: one action, scored by `score`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from tidal.core.interfaces import Environment, Task
from tidal.core.protocol import ChatMessage, ToolSpec

AGENT = "agent"  # the role of a single-agent episode
# Multi-role episodes (self-play: two players of a game). The episode names its roles (`Episode.roles`, in
# turn order) and says on each observation whose turn it is (`Observation.role`); each role sees its own
# observations and its turns become its own sample. `outcome()` returns every role's reward (a mapping).
# Task metadata the worker sets when it opens such an episode:
SCRIPTED_KEY = "tidal.scripted"  # roles (comma-separated) the environment plays itself, with its scripted player
# Assignment metadata: the role the live policy plays in every episode of the group (evaluation sets it per
# held-out game); unset, sample i of a group plays roles[i % len(roles)]
SEAT_KEY = "tidal.seat"
# Trajectory metadata of a multi-role episode's samples:
ROLE_KEY = "tidal.role"  # the role (seat) the sample's tokens played
OPPONENT_KEY = "tidal.opponent"  # who sat in the other seats: "live", "v<version>" (a snapshot), "scripted"


def snapshot_name(version: int) -> str:
    """The file name of the self-play snapshot of policy `version` in a run's snapshot folder (the learner
    writes it, rollout workers load it, the controller lists the folder)."""
    return f"v{version:06d}.safetensors"


class Observation(msgspec.Struct, kw_only=True):
    """What the model is shown next: chat messages (user text, tool results), or raw token ids for an
    environment that speaks tokens (then `messages` is empty and the renderer appends them as they are)."""

    messages: list[ChatMessage] = []
    token_ids: list[int] | None = None
    # plain text appended as it is, tokenised alone (no renderer, no separator): an agent on /v1/completions,
    # whose prompt is text that extends what was sampled
    text: str | None = None
    # `messages` (or `text`) is the whole conversation anew, not what follows the last action (an agent that
    # rewrote its history): the worker closes the sample there and starts a new one from a fresh render (a split)
    restart: bool = False
    # a multi-role episode: the role that acts next and is shown this observation ("" = the only role)
    role: str = ""


class StepResult(msgspec.Struct, kw_only=True):
    """An episode's answer to one action."""

    observation: Observation | None = None  # what to show next; None when done
    reward: float = 0.0  # this step's (process) reward, tied to the token where the action ended
    done: bool = False  # the episode is over: `outcome()` is its final reward
    # counters of this step for metrics: "tool_calls", "tool_errors", "invalid_calls", ...
    info: dict[str, float] = {}


@runtime_checkable
class Episode(Protocol):
    """One attempt at one task: single use, stepped by one driver, never shared between samples."""

    tools: Sequence[ToolSpec]  # the tools the model may call in this episode (shown by the renderer)
    roles: Sequence[str]  # who acts, in turn order; (AGENT,) for single-agent episodes
    stop: Sequence[str]  # strings that end a turn holding a tool call (its parser's); the sample keeps them

    def reset(self) -> Observation:
        """The first observation (the task, usually as a user message)."""
        ...

    def step(self, action: str, role: str = AGENT) -> StepResult:
        """Answer the text the model produced in its turn (tool calls parsed by the environment)."""
        ...

    def outcome(self) -> float:
        """The final reward once done (the verifier): a real finite number (bool, int or float). Raises
        when it cannot verify: the worker counts it as an error, never as a zero reward; so is any other
        value (None, NaN, a string such as "1.0"). A multi-role episode returns a mapping, role -> reward
        (every role of `roles`; each a real finite number)."""
        ...

    # optional: `close()`, called once when the environment process forgets the episode (finished, failed,
    # closed by the worker, or the process stopping): for an episode that holds a process or a socket


@runtime_checkable
class EpisodicEnvironment(Protocol):
    """Poses tasks (like `Environment.tasks`) and hands out an episode per sample."""

    max_turns: int  # actions per episode before the worker ends it (done, outcome then read)

    def tasks(self, split: str, seed: int) -> Iterator[Task]: ...

    def episode(self, task: Task) -> Episode: ...


class NotAReward(ValueError):
    """A reward that is not a real finite number (see `real_reward`)."""

    def __init__(self, what: str, value: Any) -> None:
        self.what, self.value = what, value
        kind = "finite" if isinstance(value, numbers.Real) else "real"
        super().__init__(f"{what} returned {value!r:.80} ({type(value).__name__}), not a {kind} number")


def _numpy_number(value: Any) -> bool:
    """A numpy bool or number scalar (`np.isclose(...)` is a np.bool_, which is no `numbers.Real`);
    read from its dtype, so that tidal.core needs no numpy here."""
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return kind in ("b", "i", "u", "f") and getattr(value, "shape", None) == ()


def real_reward(value: Any, what: str) -> float:
    """`value` as a reward; NotAReward unless it is a real finite number (bool, int, float, or a numpy
    scalar of those). A string is refused even when it reads as a number: "1.0" from a verifier is a bug
    (a parsed answer returned unconverted), and training on it would hide the bug. `what` names the
    call in the message ("outcome()", "score()")."""
    if not isinstance(value, numbers.Real) and not _numpy_number(value):
        raise NotAReward(what, value)
    reward = float(value)
    if not math.isfinite(reward):  # NaN or inf would poison every advantage of its group
        raise NotAReward(what, value)
    return reward


def is_episodic(env: Any) -> bool:
    """Whether an environment plugin hands out episodes (else it is a single-turn `Environment`)."""
    return callable(getattr(env, "episode", None))


# --------------------------------------------------------------------------- tools


class ToolCall(msgspec.Struct, kw_only=True):
    """One call the model wrote, as a parser read it."""

    name: str  # the tool's name
    arguments: dict[str, Any] = {}  # its arguments, JSON-like
    raw: str = ""  # the text it was parsed from


class ToolResult(msgspec.Struct, kw_only=True):
    """What a tool gave back. A failure is an observation for the model, not an exception."""

    content: str  # the text shown to the model (an error message when `error`)
    error: str = ""  # "" = success; else a short kind: "timeout", "crash", "output_limit", "bad_arguments", ...
    elapsed_s: float = 0.0


@runtime_checkable
class Tool(Protocol):
    """A callable tool (plugin kind ``tool``). `run` never raises for the model's mistakes and never
    hangs: bad arguments, a timeout, a crash or a flood of output come back as a `ToolResult` error."""

    spec: ToolSpec

    def run(self, arguments: Mapping[str, Any]) -> ToolResult: ...


@runtime_checkable
class ToolParser(Protocol):
    """Finds tool calls in an action's text (plugin kind ``tool_parser``)."""

    stop: Sequence[str]  # strings that end a turn holding a call (the engine stops there, string kept)

    def parse(self, text: str) -> list[ToolCall]:
        """The calls in `text` ([] = none: a final answer). Raises ValueError for a call it recognises
        but cannot read (the environment answers with an error observation)."""
        ...

    def format_result(self, call: ToolCall, result: ToolResult) -> str:
        """How a result is shown to the model (the content of a ``tool`` message)."""
        ...


# --------------------------------------------------------------------------- rendering


@runtime_checkable
class Renderer(Protocol):
    """Turns messages into tokens for one episode's sample (plugin kind ``renderer``); stateful, one per
    sample. Built as ``factory(tokenizer, **options)``."""

    stop: Sequence[str]  # strings that end an assistant turn (beside the tokenizer's EOS)

    def start(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> list[int]:
        """Prompt tokens of the conversation so far, ending where the assistant's turn begins."""
        ...

    def extend(self, action_ids: Sequence[int], messages: Sequence[ChatMessage]) -> list[int] | None:
        """After the assistant sampled `action_ids`, the tokens that append `messages` (observations) and
        open the next assistant turn. None: this renderer cannot extend the sampled tokens exactly (its
        template would render the history differently); the worker splits the sample and calls `start`
        on a new renderer with the whole conversation."""
        ...


# --------------------------------------------------------------------------- the single-turn adapter


class _SingleTurnEpisode:
    roles: Sequence[str] = (AGENT,)
    tools: Sequence[ToolSpec] = ()
    stop: Sequence[str] = ()

    def __init__(self, env: Environment, task: Task) -> None:
        self._env, self._task = env, task
        self._action: str | None = None

    def reset(self) -> Observation:
        return Observation(messages=[ChatMessage(role="user", content=self._task.prompt)])

    def step(self, action: str, role: str = AGENT) -> StepResult:
        self._action = action
        return StepResult(done=True)

    def outcome(self) -> float:
        if self._action is None:
            raise RuntimeError("outcome() before the episode's one step")
        return real_reward(self._env.score(self._task, self._action), "score()")


class SingleTurnEpisodes:
    """A single-turn `Environment` as an `EpisodicEnvironment`: one action, scored by `env.score`."""

    max_turns = 1

    def __init__(self, env: Environment) -> None:
        self.env = env

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        return self.env.tasks(split, seed)

    def episode(self, task: Task) -> Episode:
        return _SingleTurnEpisode(self.env, task)


__all__ = [
    "AGENT",
    "ChatMessage",
    "Episode",
    "EpisodicEnvironment",
    "NotAReward",
    "Observation",
    "Renderer",
    "SingleTurnEpisodes",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolParser",
    "ToolResult",
    "ToolSpec",
    "is_episodic",
    "real_reward",
]
