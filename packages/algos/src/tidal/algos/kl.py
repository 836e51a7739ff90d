"""KL estimators between the sampling policy pi (the current one) and a reference, from log-probabilities
of tokens sampled from pi (Schulman 2020, "Approximating KL Divergence"). With log r = ref - logp:

- ``k1`` = -log r                         unbiased, high variance, can be negative
- ``k2`` = (log r)^2 / 2                  biased, low variance; its gradient is the KL's gradient
- ``k3`` = (r - 1) - log r                unbiased, low variance, always >= 0 (GRPO's choice)
- ``low-var-k3``: k3 clamped to [-10, 10], as some trainers do to avoid blow-ups (verl's ``low_var_kl``,
  which verl's ``k3`` also names: a verl ``k3`` is this, not the unclamped ``k3`` here)

Straight-through variants ``k1+``, ``k3+``, ``low-var-k3+`` (verl's ``+`` suffix, e.g. ``low_var_kl+``):
the value of k1 / k3 / low-var-k3, the gradient of k2, k2 - sg(k2) + sg(k), so that the KL term logs an
unbiased KL estimate while its gradient is the KL's gradient (k1's and k3's gradients in expectation are
not; k2's is). As a reward penalty (detached) a ``+`` variant is its base estimator.

log r is first clamped to +-20 (`tidal.algos.ratio.LOG_RATIO_BOUND`): exp(20) ~ 4.9e8 is finite, and a
-inf reference logprob (a token outside the reference's support) gives a finite estimate and a zero
gradient instead of inf or NaN. Where the clamp binds the gradient is 0.

As a loss term: add ``kl_coef * aggregate(kl)`` (gradient flows through logp). As a reward penalty:
subtract ``beta * kl.detach()`` per token before computing advantages (`kl_penalty`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algos.ratio import LOG_RATIO_BOUND

KL_ESTIMATORS = ("k1", "k2", "k3", "low-var-k3", "k1+", "k3+", "low-var-k3+")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(pi || ref) estimate, [B, T]."""
    if estimator in ("k1+", "k3+", "low-var-k3+"):
        value = kl_estimate(logprobs, ref_logprobs, estimator[:-1])
        k2 = kl_estimate(logprobs, ref_logprobs, "k2")
        return k2 - k2.detach() + value.detach()  # straight through: k's value, k2's gradient
    log_r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator in ("k3", "low-var-k3"):
        kl = torch.expm1(log_r) - log_r  # expm1: exact near r = 1
        return kl.clamp(-10.0, 10.0) if estimator == "low-var-k3" else kl
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, beta: float, estimator: str = "k1") -> Tensor:
    """Per-token reward penalty beta * KL (detached), 0 where masked: subtract it from token rewards."""
    kl = kl_estimate(logprobs.detach(), ref_logprobs, estimator)
    return beta * torch.where(mask.bool(), kl, 0.0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution of each position, [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1).to(logits.dtype)
