"""The log-ratio every ratio-based loss, correction and KL estimate starts from, made safe to exponentiate.

    log_ratio(logprobs, anchor, mask) = clamp(logprobs - sg(anchor), -LOG_RATIO_BOUND, LOG_RATIO_BOUND), 0 where masked

exp(20) ~ 4.9e8 is far beyond any clip range or IS cap in use (PPO's 1.2, TIS's 2, IcePop's 5), so the
clamp changes no loss value a clip would not already have changed, and exp() of the result stays finite
in float32 and bfloat16 (not in float16, whose largest value, 65504, is about e^11). A masked position is set to 0 with `torch.where`, not a product: its inputs may
be -inf (a padded or unsupported behaviour logprob) or NaN, and neither reaches the value or the gradient.
Where the clamp binds the gradient is 0, as where PPO's clip binds.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_BOUND = 20.0


def log_ratio(logprobs: Tensor, anchor: Tensor, mask: Tensor | None = None) -> Tensor:
    """log(pi / pi_anchor) per token, the anchor detached, clamped to +-LOG_RATIO_BOUND; 0 where `mask` is False."""
    lr = (logprobs - anchor.detach()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if mask is None:
        return torch.where(torch.isnan(lr), torch.zeros_like(lr), lr)
    return torch.where(mask.bool(), lr, torch.zeros_like(lr))
