"""Reward shaping that needs torch."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, *, max_length: int, cache: int) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward:
    0 for |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache inside the cache window (0 to -1);
    -1 beyond L_max."""
    if not 0 < cache <= max_length:
        raise ValueError(f"cache must be in (0, max_length]; got cache={cache}, max_length={max_length}")
    lengths = lengths.to(torch.float32)
    soft = (max_length - cache - lengths) / cache
    return torch.where(
        lengths <= max_length - cache,
        torch.zeros_like(lengths),
        torch.where(lengths <= max_length, soft, torch.full_like(lengths, -1.0)),
    )
