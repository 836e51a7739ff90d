"""Objectives built for stale (off-policy) data: OAPL, M2PO and TOPR.

Each loss takes a `LossInputs` and returns a `LossOutputs`, like those of tidal.algos.losses, and
shares their tail (`_finish`: IS weights, aggregation, KL and entropy terms, shared metrics). Every
log-ratio that is exponentiated or squared comes from `tidal.algos.ratio.log_ratio` (clamped to +-20,
0 at masked positions), so a -inf behaviour logprob at a masked position reaches neither the value
nor the gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algos.losses import _advantages, _finish, _fraction, _ratio_metrics
from tidal.algos.ratio import log_ratio
from tidal.algos.types import LossInputs, LossOutputs


def oapl_advantages(rewards: Tensor, group_index: Tensor, beta: float = 1.0) -> Tensor:
    """OAPL's advantage (Ritter, Oertell, Guo, Chang, Brantley, Sun 2026, "LLMs Can Learn to Reason Via
    Off-Policy RL", arXiv 2602.19362, the optimal value of the KL-regularised objective estimated from
    the group's samples of pi_lag; equation numbers not checked against the paper's text here):
    V*_g = beta * log mean_{j in g} exp(r_j / beta), A_i = r_i - V*_g.

    `beta` is the paper's beta_1. V* lies between the group mean (beta -> inf: Dr.GRPO's r - mean) and
    the group max (beta -> 0), so A is a soft-max baseline that any policy-gradient loss may use; it
    is the residual target of `oapl_loss`. Computed with a per-group logsumexp in float64 (stable for
    any reward scale / beta). Returns [B] in the rewards' dtype.
    """
    if beta <= 0:
        raise ValueError(f"beta (OAPL's beta_1) must be > 0, got {beta}")
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards must be [B] and group_index [B]; got {tuple(rewards.shape)} and {tuple(group_index.shape)}"
        )
    if rewards.numel() == 0:
        return rewards.clone()
    idx = group_index.to(torch.long)
    z = rewards.to(torch.float64) / beta
    n_groups = int(idx.max().item()) + 1
    # logsumexp per group: subtract the group max so that exp() cannot overflow
    top = torch.full((n_groups,), -torch.inf, dtype=z.dtype, device=z.device).scatter_reduce(0, idx, z, "amax")
    sums = torch.zeros(n_groups, dtype=z.dtype, device=z.device).index_add_(0, idx, (z - top[idx]).exp())
    count = torch.zeros(n_groups, dtype=z.dtype, device=z.device).index_add_(0, idx, torch.ones_like(z))
    v_star = beta * (top[idx] + sums[idx].log() - count[idx].log())
    return (rewards.to(torch.float64) - v_star).to(rewards.dtype)


def _seq_sum(x: Tensor, m: Tensor) -> Tensor:
    """Sum over each sequence's masked tokens (`torch.where`: a NaN or inf elsewhere stays out)."""
    return torch.where(m > 0, x, 0.0).sum(-1)


def oapl_loss(
    inputs: LossInputs,
    *,
    beta: float = 1.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
) -> LossOutputs:
    """OAPL (Ritter et al. 2026, arXiv 2602.19362, the least-squares regression of the optimal advantage
    of the KL-regularised objective towards pi_lag; equation numbers not checked against the paper here):
    L = mean_i [beta * log(pi_theta(y_i) / pi_lag(y_i)) - A_i]^2, A_i = r_i - V*_g (`oapl_advantages`),

    with sequence log-probabilities (sums over each sequence's masked tokens) and the mean over the
    sequences with at least one masked token (0 for an empty batch). `beta` is the paper's beta_2. No
    ratio is exponentiated and nothing is clipped: the KL regulariser towards pi_lag is in the target.

    pi_lag is `inputs.anchor_logprobs`: the learner's recomputed lagged logprobs when it passes
    `old_logprobs`, else the sampler's. A_i is read from `inputs.advantages` as the mean over the
    sequence's masked tokens (what `OAPLEstimator` broadcast). The learner must pair it with the
    advantage "oapl" and no staleness correction (`requires_advantage`, `refuses_correction`): it
    refuses `is_weights` here too. kl_coef / entropy_coef add their terms summed over each sequence's
    tokens and averaged over sequences, the loss's own aggregation ("seq-mean-token-sum").
    """
    if inputs.is_weights is not None:
        raise ValueError("oapl_loss takes no is_weights: OAPL is built for off-policy data and has no ratio to weight")
    mask = inputs.mask
    m = inputs.float_mask
    lr = log_ratio(inputs.logprobs, inputs.anchor_logprobs, mask)
    tokens = m.sum(-1)
    has = tokens > 0
    seq_lr = _seq_sum(lr, m)  # log pi_theta(y) - log pi_lag(y)
    adv = _seq_sum(_advantages(inputs), m) / tokens.clamp(min=1)
    residual = beta * seq_lr - adv
    # spread each sequence's squared residual evenly over its tokens, so that the shared tail's
    # "seq-mean-token-sum" gives exactly mean_i residual_i^2 (and adds KL / entropy the same way)
    per_token = (residual.square() / tokens.clamp(min=1))[:, None] * m
    metrics = _ratio_metrics(lr, mask)
    hf = has.to(m.dtype)
    n = hf.sum().clamp(min=1)
    metrics["oapl/seq_log_ratio_mean"] = (seq_lr.detach() * hf).sum() / n
    metrics["oapl/residual_mean"] = (residual.detach() * hf).sum() / n
    return _finish(per_token, inputs, metrics, agg="seq-mean-token-sum", kl_coef=kl_coef,
                   kl_estimator=kl_estimator, entropy_coef=entropy_coef, norm_length=None)


# what the learner reads of it (tidal.algos.plugin.LOSS_TRAITS)
oapl_loss.aggregation = "seq-mean-token-sum"  # type: ignore[attr-defined]  # a mean over sequences
oapl_loss.requires_advantage = "oapl"  # type: ignore[attr-defined]  # its residual is r - V*, not another baseline
oapl_loss.refuses_correction = (  # type: ignore[attr-defined]
    "OAPL is built for off-policy data: its KL-regularised target already accounts for pi_lag, and it has "
    "no ratio for an importance weight to correct"
)


@torch.no_grad()
def m2po_mask(m2: Tensor, candidates: Tensor, tau: float) -> Tensor:
    """M2PO's Algorithm 1 (Zheng, Zhao, Chen 2025, arXiv 2510.01161): among the `candidates` (bool),
    drop the tokens of largest m2 = (log r)^2 until the mean m2 of those left is <= tau. Returns the
    bool mask of the dropped tokens.

    Removing the largest value never raises the mean, so the greedy loop keeps exactly the largest
    prefix of the ascending sort whose mean is <= tau: found with one sort and a cumulative sum.
    """
    flat = m2.reshape(-1)
    cand = candidates.reshape(-1)
    values = flat[cand]
    drop = torch.zeros_like(cand)
    if values.numel() == 0:
        return drop.view_as(candidates)
    order = torch.argsort(values, stable=True)
    prefix = values[order].double().cumsum(0)
    count = torch.arange(1, values.numel() + 1, device=values.device, dtype=torch.float64)
    kept = int((prefix <= tau * count).sum())  # the prefix means ascend: the True ones form a prefix
    dropped_sorted = torch.arange(values.numel(), device=values.device) >= kept
    dropped = torch.zeros_like(dropped_sorted)
    dropped[order] = dropped_sorted
    drop[cand.nonzero().squeeze(-1)] = dropped
    return drop.view_as(candidates)


def m2po_loss(
    inputs: LossInputs,
    *,
    tau: float = 0.04,
    trust_region_only: bool = True,
    agg: str = "token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    norm_length: float | None = None,
) -> LossOutputs:
    """M2PO (Zheng, Zhao, Chen 2025, "Prosperity before Collapse", arXiv 2510.01161, eq. 4, Algorithm 1
    and eq. 5): with M2 = mean (log r_t)^2, r_t = pi_theta / pi_anchor, mask the tokens of largest
    (log r_t)^2 (`m2po_mask`) until the M2 of those kept is <= tau (paper: 0.04), then
    L = -(1 / N) sum_t M_t r_t A_t, the importance-weighted surrogate without PPO's clip.

    `trust_region_only` (paper): the candidates for masking are the tokens PPO's clip could act on,
    A > 0 with r > 1 or A < 0 with r < 1, and M2 is their mean; False: every valid token. As the paper
    (footnote 2), the default "token-mean" averages over all valid tokens, masked ones included. The
    threshold is applied to each loss call, i.e. per micro-batch in the learner, not over the whole step.
    """
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    mask = inputs.mask.bool()
    lr = log_ratio(inputs.logprobs, inputs.anchor_logprobs, mask)
    ratio = lr.exp()
    adv = _advantages(inputs)
    m2 = lr.detach().square()
    r = ratio.detach()
    candidates = mask & ((adv > 0) & (r > 1) | (adv < 0) & (r < 1)) if trust_region_only else mask
    drop = m2po_mask(m2, candidates, tau)
    keep = (~drop).to(ratio.dtype)
    per_token = -keep * ratio * adv
    metrics = _ratio_metrics(lr, mask, ratio)
    cf = candidates.to(m2.dtype)
    kept_cf = cf * keep.detach()
    metrics["m2po/masked_frac"] = _fraction(drop, mask, metrics)
    metrics["m2po/m2_before"] = (m2 * cf).sum() / cf.sum().clamp(min=1)
    metrics["m2po/m2_after"] = (m2 * kept_cf).sum() / kept_cf.sum().clamp(min=1)
    return _finish(per_token, inputs, metrics, agg=agg, kl_coef=kl_coef, kl_estimator=kl_estimator,
                   entropy_coef=entropy_coef, norm_length=norm_length)


def topr_loss(
    inputs: LossInputs,
    *,
    level: str = "sequence",
    agg: str = "seq-mean-token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    norm_length: float | None = None,
) -> LossOutputs:
    """TOPR (Le Roux, Bellemare, Lebensold, Bergeron, Greaves, Frechette et al. 2025, "Tapered Off-Policy
    REINFORCE", arXiv 2503.14286, §3 eqs. 7-8 with a- = 0 and the other limits 1):
    L = -sum_{A >= 0} A log pi(y) - sum_{A < 0} sg(clip(rho, 0, 1)) A log pi(y), rho = pi(y) / mu(y).

    Positive samples get plain REINFORCE (SFT on them), negative ones truncated IS whose weight decays
    as the policy moves away from them, so no log-probability is pushed to -inf. `level="sequence"`
    (paper): rho is the sequence ratio exp(sum_t log r_t) and the sign is the sequence's mean advantage;
    "token": per-token ratio and sign. min(rho, 1) is computed as exp(min(log rho, 0)): never overflows.
    The default aggregation divides each sequence by its length, as the paper's experiments (§4.1).
    """
    if level not in ("sequence", "token"):
        raise ValueError(f"level must be 'sequence' or 'token', got {level!r}")
    mask = inputs.mask
    m = inputs.float_mask
    lr = log_ratio(inputs.logprobs, inputs.anchor_logprobs, mask).detach()
    adv = _advantages(inputs)
    if level == "sequence":
        seq_adv = _seq_sum(adv, m) / m.sum(-1).clamp(min=1)
        log_rho = _seq_sum(lr, m)[:, None].expand_as(lr)
        negative = (seq_adv < 0)[:, None].expand_as(lr)
    else:
        log_rho, negative = lr, adv < 0
    weight = torch.where(negative, log_rho.clamp(max=0.0).exp(), torch.ones_like(lr))
    per_token = -weight * adv * inputs.logprobs
    metrics = _ratio_metrics(lr, mask)
    metrics["topr/negative_frac"] = _fraction(negative, mask, metrics)
    metrics["topr/truncated_frac"] = _fraction(negative & (log_rho > 0), mask, metrics)
    return _finish(torch.where(mask.bool(), per_token, torch.zeros_like(per_token)), inputs, metrics, agg=agg,
                   kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef, norm_length=norm_length)
