"""Group filters the buffer applies to complete groups (plugin kind ``group_filter``).

Pure Python on purpose: they run inside the buffer service, which has no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.core.protocol import Trajectory


class ZeroVarianceFilter:
    """DAPO dynamic sampling (Yu et al. 2025, eq. 11): drop groups whose rewards are all equal
    (within `tol`). With group-normalised advantages such groups carry no gradient, only noise."""

    def __init__(self, tol: float = 0.0) -> None:
        self.tol = tol

    def __call__(self, group: Sequence[Trajectory]) -> bool:
        rewards = [t.reward for t in group]
        return bool(rewards) and max(rewards) - min(rewards) > self.tol


def has_reward_variance(rewards: Sequence[float], tol: float = 0.0) -> bool:
    """True when the rewards differ by more than `tol`: the group is worth training on."""
    return bool(rewards) and max(rewards) - min(rewards) > tol


class LengthFilter:
    """Drop a group when any (or every, with `require_all=True`) completion is longer than
    `max_tokens` or shorter than `min_tokens`."""

    def __init__(self, max_tokens: int | None = None, min_tokens: int = 0, require_all: bool = False) -> None:
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.require_all = require_all

    def __call__(self, group: Sequence[Trajectory]) -> bool:
        def ok(t: Trajectory) -> bool:
            n = t.completion_ids.shape[0] if t.completion_ids.shape else 0
            return n >= self.min_tokens and (self.max_tokens is None or n <= self.max_tokens)

        verdicts = [ok(t) for t in group]
        return any(verdicts) if self.require_all else all(verdicts)
