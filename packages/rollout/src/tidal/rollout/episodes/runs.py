"""A multi-turn sample as the rollout worker holds it while its episode runs: the episode (`EpisodeRun`),
a seat per role (`Seat`: one in a single-role episode), each seat's segments of tokens (`Segment`), and
a finished seat's segments as wire `Trajectory`s. `tidal.rollout.episodes.multiturn` drives them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.core.arrays import Array
from tidal.core.episodes import OPPONENT_KEY, ROLE_KEY
from tidal.core.protocol import NO_VERSION, Assignment, ChatMessage, ToolSpec, Trajectory, segment_id


@dataclass
class Segment:
    """One trajectory's worth of an episode: a prompt and the completion tokens after it."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # per token the oldest version in the KV cache it attended to (each turn is a fresh request, so the
    # engine rebuilt the history's KV for it and reports it); None once a turn's engine could not tell
    kv_versions: list[int] | None = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    step_ends: list[int] = field(default_factory=list)
    finish: str = ""

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None = None, versions: Sequence[int] | None = None,
            kv_versions: Sequence[int] | None = None) -> None:
        """Append sampled tokens (with their logprobs, versions and KV versions) or, without them, rendered ones."""
        self.ids.extend(ids)
        if logprobs is None:
            self.logprobs.extend([0.0] * len(ids))
            self.versions.extend([NO_VERSION] * len(ids))
            if self.kv_versions is not None:
                self.kv_versions.extend([NO_VERSION] * len(ids))
            self.mask.extend([0] * len(ids))
        else:
            self.logprobs.extend(logprobs)
            self.versions.extend(versions or [])
            if kv_versions is None:
                self.kv_versions = None
            elif self.kv_versions is not None:
                self.kv_versions.extend(kv_versions)
            self.mask.extend([1] * len(ids))


@dataclass
class Seat:
    """One role of an episode as one player sees it: its own renderer, conversation and tokens."""

    role: str = ""  # "" in a single-role episode
    trained: bool = True  # played by the live policy: its segments are delivered
    snapshot: int | None = None  # played by the frozen snapshot of this version (not trained)
    renderer: Any = None
    segments: list[Segment] = field(default_factory=list)
    conversation: list[ChatMessage] = field(default_factory=list)
    last_action: list[int] = field(default_factory=list)
    turns: int = 0  # actions this seat took

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)


@dataclass
class EpisodeRun:
    """One sample's episode as the worker drives it: one seat per role (a single-role episode has one)."""

    group_id: str
    index: int
    id: str  # the sample's trajectory id, also the episode id the environment process knows
    seats: dict[str, Seat] = field(default_factory=lambda: {"": Seat()})
    role: str = ""  # the seat that acts now
    live_role: str = ""  # multi-role: the seat the live policy plays (scored against the opponent)
    opponent: str = ""  # multi-role: who plays the other seats ("live", "v<N>", "scripted")
    tools: list[ToolSpec] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    max_turns: int = 1
    turns: int = 0  # actions taken, every seat's (EpisodeStep seq of the last one)
    outcome: float | None = None  # set when done (multi-role: the live seat's reward)
    outcomes: dict[str, float] = field(default_factory=dict)  # multi-role: every role's reward
    info: dict[str, float] = field(default_factory=dict)
    retries: int = 0  # how many earlier episodes of this sample failed and were run again
    failed: str = ""  # why it failed, its own text (the group goes on without it: on_error = "survivors")
    turn_versions: list[int] = field(default_factory=list)  # each action's newest policy version (transcripts)

    @property
    def seat(self) -> Seat:
        return self.seats[self.role]

    # the acting seat's (a single-role episode's only seat's): what transcripts and tests read
    @property
    def segments(self) -> list[Segment]:
        return self.seat.segments

    @property
    def conversation(self) -> list[ChatMessage]:
        return self.seat.conversation

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def tokens(self) -> int:
        return self.seat.tokens


def arr(values: Sequence[Any], dtype: Any) -> Array:
    return Array.from_numpy(np.asarray(values, dtype))


def trajectory(a: Assignment, run: EpisodeRun, k: int, seg: Segment, source: str, seat: Seat) -> Trajectory:
    info = {f"tidal.episode.{name}": f"{v:g}" for name, v in run.info.items()}
    roles = {ROLE_KEY: seat.role, OPPONENT_KEY: run.opponent} if run.live_role else {}
    reward = run.outcomes.get(seat.role, 0.0) if run.live_role else run.outcome
    return Trajectory(
        id=segment_id(run.id, k), group_id=a.group_id, sample_index=run.index, task=a.task,
        prompt_ids=arr(seg.prompt, np.int32), completion_ids=arr(seg.ids, np.int32),
        logprobs=arr(seg.logprobs, np.float32), versions=arr(seg.versions, np.int32),
        kv_versions=None if seg.kv_versions is None else arr(seg.kv_versions, np.int32),
        reward=float(reward or 0.0), finish_reason=seg.finish or "stop",
        step_rewards=arr(seg.step_rewards, np.float32), step_ends=arr(seg.step_ends, np.int32),
        loss_mask=arr(seg.mask, np.uint8),
        metadata={**a.metadata, **info, **roles, "tidal.episode.turns": str(seat.turns if run.live_role else run.turns),
                  "tidal.episode.segment": str(k)},
        source=source, sampling=a.sampling,
    )


__all__ = ["EpisodeRun", "Seat", "Segment", "arr", "trajectory"]
