"""Config Structs of every staleness policy (TOML sections of a run; `tidal.core.config` loads them)."""

from __future__ import annotations

from typing import Literal

from tidal.core.config import ConfigStruct


class VersionRejectionConfig(ConfigStruct):
    max_lag: int = 4  # most versions a token may lag the learner's current version
    mode: Literal["drop", "mask"] = "drop"  # drop the whole sequence, or keep it and mask stale tokens


class DepthGateConfig(ConfigStruct):
    max_staleness: int = 2  # most versions a sample may be behind when trained on
    batch_size: int = 64  # samples the learner consumes per version
    state_path: str = ""  # where the gate persists its counters; "" keeps them in memory only
    fsync: bool = False  # fsync each state write (survives power loss, not only process death)


class TokenTISConfig(ConfigStruct):
    cap: float = 2.0  # C: token weights are min(pi_learner / pi_sampler, C)


class SequenceTISConfig(ConfigStruct):
    cap: float = 2.0  # C: sequence weight is min(geometric-mean ratio, C)


class MaskedISConfig(ConfigStruct):
    low: float = 0.5  # tokens/sequences with ratio below this are masked out
    high: float = 2.0  # ... or above this
    level: Literal["token", "sequence"] = "token"  # ratio per token, or geometric mean per sequence


class IcePopConfig(ConfigStruct):
    low: float = 0.5  # tokens with pi_learner / pi_sampler below this are masked out
    high: float = 5.0  # ... or above this; inside [low, high] a token keeps the ratio as its weight


class KVLagMaskConfig(ConfigStruct):
    max_kv_lag: int = 4  # mask tokens whose KV cache is more than this many versions behind the learner


class OffPolicySequenceMaskConfig(ConfigStruct):
    delta: float = 1e-3  # mask a negative-advantage sequence whose mean mismatch KL exceeds this


class DecoupledPPOConfig(ConfigStruct):
    cap: float | None = None  # optional truncation of the behaviour weight pi_prox / pi_behav
