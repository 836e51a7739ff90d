"""How per-token losses become one scalar. The choice changes which tokens and sequences weigh most.

- ``token-mean``: every valid token in the batch weighs the same (DAPO's token-level loss). Long
  sequences contribute more tokens, so more weight.
- ``seq-mean-token-mean``: mean over each sequence's tokens, then over sequences (original GRPO).
  Every sequence weighs the same whatever its length; tokens of short sequences weigh more.
- ``seq-mean-token-sum``: sum over each sequence's tokens, then mean over sequences.
- ``seq-mean-token-sum-norm``: sum over all valid tokens divided by B × a constant length (Dr.GRPO,
  Liu et al. 2025): no length bias; the constant defaults to the padded length T.
- ``token-sum``: the sum over all valid tokens, not normalised (e.g. Tinker's and some SFT losses'
  convention): the gradient scales with the number of tokens in the step, so the learning rate does
  too. The learner gives each micro-batch a share of 1, so the step's loss is the whole batch's sum.

Sequences without any valid token are left out of sequence means (they add nothing and divide nothing);
a batch without any valid token gives 0, never NaN. Masked positions are zeroed with `torch.where`, not
multiplied by 0: a NaN or inf there (0 * inf = NaN) reaches neither the result nor its gradient.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                              "token-sum")


def aggregate(values: Tensor, mask: Tensor, mode: str = "token-mean", norm_length: float | None = None) -> Tensor:
    """Reduce [B, T] per-token `values` to a scalar over the positions where `mask` is set."""
    m = mask.to(values.dtype)
    masked = torch.where(mask.bool(), values, 0.0)
    if mode == "token-mean":
        return masked.sum() / m.sum().clamp(min=1)
    if mode == "token-sum":
        return masked.sum()
    if mode == "seq-mean-token-sum-norm":
        length = values.shape[-1] if norm_length is None else norm_length
        return masked.sum() / (values.shape[0] * length) if values.numel() else masked.sum()
    tokens = m.sum(-1)
    has_tokens = (tokens > 0).to(values.dtype)
    n_seq = has_tokens.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / tokens.clamp(min=1)
        return (per_seq * has_tokens).sum() / n_seq
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / n_seq
    raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {', '.join(AGG_MODES)}")


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked positions (0 when there are none), detached-friendly helper for metrics."""
    m = mask.to(values.dtype)
    return torch.where(mask.bool(), values, 0.0).sum() / m.sum().clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(values - mean) / std over masked positions; masked-out positions become 0."""
    m = mask.bool()
    n = m.sum().to(values.dtype).clamp(min=1)
    zeroed = torch.where(m, values, 0.0)
    centered = torch.where(m, zeroed - zeroed.sum() / n, 0.0)
    return centered * torch.rsqrt(centered.square().sum() / n + eps)
