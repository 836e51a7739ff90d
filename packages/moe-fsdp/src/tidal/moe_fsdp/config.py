"""The one config of an MoE block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SCORES = ("softmax", "sigmoid")


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Shape and routing of one MoE block: `num_experts` SwiGLU experts of width `intermediate_size`
    over a `hidden_size` residual stream, each token sent to `top_k` of them."""

    hidden_size: int  # H
    intermediate_size: int  # F, per expert
    num_experts: int  # E, across the whole expert-parallel group
    top_k: int  # experts per token
    score: Literal["softmax", "sigmoid"] = "softmax"  # how router logits become probabilities
    normalize: bool = True  # renormalise the top-k probabilities to sum to 1 per token
    recompute: bool = False  # keep no expert activations for backward; recompute them one expert at a time

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name}={getattr(self, name)} must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                             "a token cannot visit more experts than exist")
        if self.score not in SCORES:
            raise ValueError(f"MoEConfig.score={self.score!r} is not one of {SCORES}")
