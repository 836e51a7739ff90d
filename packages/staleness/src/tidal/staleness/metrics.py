"""Per-step staleness metrics: mismatch KL, effective sample size, masked fractions, lag histogram."""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.staleness.correction import Correction


def mismatch_kl(learner_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """KL(sampler || learner) estimated on the sampler's tokens, k1 and k3 (Schulman 2020), token mean.
    k1 = log pi_s - log pi_l; k3 = r - 1 - log r with r = pi_l / pi_s. Both are unbiased; k3 is >= 0."""
    lr = (learner_logprobs - behaviour_logprobs).detach().double()
    m = mask.to(torch.float64)
    n = m.sum().clamp(min=1)
    return {
        "mismatch/kl_k1": ((-lr) * m).sum() / n,
        "mismatch/kl_k3": ((torch.expm1(lr) - lr) * m).sum() / n,
    }


def effective_sample_size(weights: Tensor, mask: Tensor | None = None) -> Tensor:
    """Normalised ESS = (sum w)^2 / (N sum w^2) over the valid entries: 1 when all weights are equal,
    1/N when one weight carries everything (Kong 1992)."""
    w = weights.detach().double()
    if mask is not None:
        w = w[mask.bool()]
    n = w.numel()
    if n == 0:
        return torch.ones((), dtype=torch.float64)
    denom = n * (w * w).sum()
    return torch.where(denom > 0, w.sum() ** 2 / denom.clamp(min=1e-300), torch.zeros((), dtype=torch.float64))


def lag_histogram(versions: Tensor, mask: Tensor, current_version: int, num_bins: int = 16) -> Tensor:
    """Token counts per lag 0..num_bins-2, last bin >= num_bins-1."""
    lags = (current_version - versions.long())[mask.bool()].clamp(0, num_bins - 1)
    return torch.bincount(lags, minlength=num_bins)


def sequence_lags(versions: Tensor, mask: Tensor, current_version: int) -> dict[str, Tensor]:
    """Per-sequence min / max / mean lag over valid tokens ([B] each; 0 for empty sequences)."""
    m = mask.bool()
    lags = (current_version - versions.long())
    big = torch.iinfo(torch.long).max
    has = m.any(-1)
    lo = torch.where(has, lags.masked_fill(~m, big).min(-1).values, 0)
    hi = torch.where(has, lags.masked_fill(~m, -big).max(-1).values, 0)
    mean = (lags * m).sum(-1).double() / m.sum(-1).clamp(min=1)
    return {"min": lo, "max": hi, "mean": mean}


def step_metrics(
    learner_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    correction: Correction | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
) -> dict[str, Tensor]:
    """Everything the learner logs about staleness for one step."""
    out = dict(mismatch_kl(learner_logprobs, behaviour_logprobs, mask))
    m = mask.bool()
    if correction is not None:
        out.update(correction.metrics)
        dropped = m & ~correction.mask
        out["is/token_masked_total_frac"] = dropped.sum().double() / m.sum().clamp(min=1)
        seq_has = m.any(-1)
        seq_dropped = seq_has & ~(correction.mask & m).any(-1)
        out["is/seq_masked_total_frac"] = seq_dropped.sum().double() / seq_has.sum().clamp(min=1)
        out["is/ess"] = effective_sample_size(correction.weights, correction.mask)
    if versions is not None and current_version is not None:
        lags = sequence_lags(versions, mask, current_version)
        has = m.any(-1)
        out["lag/max"] = lags["max"][has].max().double() if has.any() else torch.zeros((), dtype=torch.float64)
        out["lag/mean"] = lags["mean"][has].mean() if has.any() else torch.zeros((), dtype=torch.float64)
    return out
