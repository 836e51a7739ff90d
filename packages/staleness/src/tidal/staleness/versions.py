"""Version accounting: how far behind the learner each token of a trajectory is. Pure numpy (the
buffer uses it, and the buffer has no torch).

A trajectory generated across a weight update has mixed versions, non-decreasing along the completion:
older tokens first. Lag of a token = learner's current version - the token's version. Tokens the policy
did not sample (observations inside a multi-turn sample: version `NO_VERSION`, -1) have no lag: they are
left out of every statistic here and are never the reason a trajectory is trimmed or dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LagStats:
    min_lag: int  # lag of the freshest token
    max_lag: int  # lag of the stalest token
    mean_lag: float  # mean over tokens


NO_VERSION = -1  # tidal.core.protocol.NO_VERSION: a token the policy did not sample


def sampled(versions: Sequence[int] | np.ndarray) -> np.ndarray:
    """Boolean mask of the tokens the policy sampled (version >= 0)."""
    return np.asarray(versions, dtype=np.int64) > NO_VERSION


def token_lags(versions: Sequence[int] | np.ndarray, current_version: int) -> np.ndarray:
    """Per-token lag (int64), 0 for tokens the policy did not sample. Negative lag means a token claims a
    version the learner has not reached."""
    v = np.asarray(versions, dtype=np.int64)
    return np.where(v > NO_VERSION, current_version - v, 0)


def lag_stats(versions: Sequence[int] | np.ndarray, current_version: int) -> LagStats:
    """Min/max/mean lag of one trajectory's sampled tokens; none sampled: lag 0."""
    lags = token_lags(versions, current_version)[sampled(versions)]
    if lags.size == 0:
        return LagStats(0, 0, 0.0)
    return LagStats(int(lags.min()), int(lags.max()), float(lags.mean()))


def lag_histogram(lags: Sequence[int] | np.ndarray, num_bins: int = 16) -> np.ndarray:
    """Counts of lags 0, 1, ..., num_bins - 2 and a last bin for >= num_bins - 1 (negatives clipped to 0)."""
    lags = np.clip(np.asarray(lags, dtype=np.int64), 0, num_bins - 1)
    return np.bincount(lags, minlength=num_bins).astype(np.int64)
