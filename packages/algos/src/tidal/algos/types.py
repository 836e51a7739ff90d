"""`LossInputs` and `LossOutputs`: what every policy loss takes and returns.

Shapes use B = sequences in the batch, T = completion tokens (padded or packed per row). Every per-token
tensor is [B, T] and aligned with `logprobs`; `mask` says which positions are real completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor


@dataclass(kw_only=True, slots=True)
class LossInputs:
    logprobs: Tensor  # [B, T] log pi_theta(token) under the current policy (carries the gradient)
    behaviour_logprobs: Tensor  # [B, T] logprobs the sampler drew with (processed distribution)
    advantages: Tensor  # [B, T] per-token advantages (broadcast sequence advantages with the mask)
    mask: Tensor  # [B, T] bool/0-1: True where the token is trained on
    old_logprobs: Tensor | None = None  # [B, T] proximal / pre-update policy; ratio anchor when given
    ref_logprobs: Tensor | None = None  # [B, T] frozen reference (KL) or teacher (distillation) logprobs
    is_weights: Tensor | None = None  # [B, T] per-token importance weights from tidal-staleness (no grad)
    entropy: Tensor | None = None  # [B, T] policy entropy per position, for the entropy bonus
    values: Tensor | None = None  # [B, T] critic values (PPO value loss)
    old_values: Tensor | None = None  # [B, T] critic values at rollout time (value clipping)
    returns: Tensor | None = None  # [B, T] value targets (from GAE)

    def __post_init__(self) -> None:
        check_inputs(self)

    @property
    def anchor_logprobs(self) -> Tensor:
        """The policy the ratio is taken against: the proximal/old policy if given, else the sampler's."""
        return self.old_logprobs if self.old_logprobs is not None else self.behaviour_logprobs

    @property
    def float_mask(self) -> Tensor:
        return self.mask.to(self.logprobs.dtype if self.logprobs.is_floating_point() else torch.float32)


@dataclass(kw_only=True, slots=True)
class LossOutputs:
    loss: Tensor  # scalar to call .backward() on
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached 0-d tensors, name -> value


def check_inputs(inputs: LossInputs) -> None:
    """Raise ValueError naming the field when a tensor is missing, mis-shaped or of a wrong dtype."""
    ref = inputs.logprobs
    if not isinstance(ref, Tensor) or ref.dim() != 2:
        raise ValueError(
            f"LossInputs.logprobs must be a [batch, tokens] tensor, got "
            f"{tuple(ref.shape) if isinstance(ref, Tensor) else type(ref).__name__}"
        )
    if not ref.is_floating_point():
        raise ValueError(f"LossInputs.logprobs must be floating point, got {ref.dtype}")
    for f in fields(inputs):
        value = getattr(inputs, f.name)
        if value is None or f.name == "logprobs":
            continue
        if not isinstance(value, Tensor):
            raise ValueError(f"LossInputs.{f.name} must be a tensor, got {type(value).__name__}")
        if value.shape != ref.shape:
            raise ValueError(
                f"LossInputs.{f.name} has shape {tuple(value.shape)} but logprobs has {tuple(ref.shape)}; "
                "every per-token tensor must be [batch, tokens] and aligned with logprobs"
            )
        if f.name != "mask" and not value.is_floating_point():
            raise ValueError(f"LossInputs.{f.name} must be floating point, got {value.dtype}")
        if value.device != ref.device:
            raise ValueError(f"LossInputs.{f.name} is on {value.device} but logprobs is on {ref.device}")


def require(inputs: LossInputs, name: str, loss: str) -> Tensor:
    value = getattr(inputs, name)
    if value is None:
        raise ValueError(f"{loss} needs LossInputs.{name}, which is None")
    return value
