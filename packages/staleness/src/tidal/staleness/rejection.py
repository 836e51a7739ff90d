"""Version rejection (`max_lag`): admit, trim or drop a trajectory by the versions of its tokens.

Use it at the buffer (admission) and again when a batch is served: it is the hard guarantee that no
token older than `max_lag` versions is trained on, whatever the generation order. Pure Python/numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tidal.core.interfaces import Admission
from tidal.staleness.config import VersionRejectionConfig
from tidal.staleness.versions import sampled, token_lags


class VersionRejection:
    """``mode="drop"``: drop the trajectory if any token lags more than `max_lag`.
    ``mode="mask"``: keep it and mask exactly the stale tokens (the older prefix; later tokens were
    sampled by a fresh enough policy and stay trainable); drop only if nothing is left.

    A token whose version is *ahead* of the learner means state was lost or mixed between runs; such a
    trajectory is dropped with reason "version_ahead" rather than trusted."""

    def __init__(self, max_lag: int = 4, mode: str = "drop") -> None:
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {max_lag}")
        if mode not in ("drop", "mask"):
            raise ValueError(f"mode must be 'drop' or 'mask', got {mode!r}")
        self.max_lag = max_lag
        self.mode = mode

    @classmethod
    def from_config(cls, cfg: VersionRejectionConfig) -> VersionRejection:
        return cls(cfg.max_lag, cfg.mode)

    def admit(self, versions: Sequence[int] | np.ndarray, current_version: int) -> Admission:
        lags = token_lags(versions, current_version)  # 0 for tokens not sampled (never stale)
        if lags.size and lags.min() < 0:
            return Admission(admit=False, reason="version_ahead")
        stale = lags > self.max_lag
        if not stale.any():
            return Admission(admit=True)
        if self.mode == "drop" or stale[sampled(versions)].all():
            return Admission(admit=False, reason="stale")
        return Admission(admit=True, token_mask=(~stale).tolist(), reason="stale_tokens_masked")
