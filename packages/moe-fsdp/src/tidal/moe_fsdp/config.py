"""The one config of an MoE block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SCORES = ("softmax", "sigmoid")
LAYOUTS = ("mixtral", "gpt_oss")


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
    # "mixtral": Mixtral / Qwen3-MoE experts (router `gate`, no biases, SwiGLU); "gpt_oss": GPT-OSS experts
    # (router `router` with a bias; interleaved gate/up [E, H, 2F] with biases; clamped SwiGLU)
    layout: Literal["mixtral", "gpt_oss"] = "mixtral"
    swiglu_alpha: float = 1.702  # gpt_oss: the sigmoid gain of gate · σ(alpha · gate)
    swiglu_limit: float = 7.0  # gpt_oss: gate clamped above at +limit, up at ±limit

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name}={getattr(self, name)} must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                             "a token cannot visit more experts than exist")
        if self.score not in SCORES:
            raise ValueError(f"MoEConfig.score={self.score!r} is not one of {SCORES}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"MoEConfig.layout={self.layout!r} is not one of {LAYOUTS}")
