"""Advantage estimators. Sequence-level ones take scalar rewards [B] and the group of each sample [B]
(samples of one prompt share a group index; groups need not be contiguous or equal in size) and return
[B]; `to_tokens` broadcasts them onto the completion tokens. GAE and REINFORCE++ work per token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algos.aggregation import masked_whiten


def _check(rewards: Tensor, group_index: Tensor) -> Tensor:
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards must be [B] and group_index [B]; got {tuple(rewards.shape)} and {tuple(group_index.shape)}"
        )
    return group_index.to(torch.long)


def _group_sum(values: Tensor, idx: Tensor) -> Tensor:
    """Sum of `values` over each sample's group, gathered back to [B]."""
    n_groups = int(idx.max().item()) + 1 if idx.numel() else 0
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, idx, values)[idx]


def _group_mean(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """(group size, group mean) per sample, in float64 (exact for the group sizes RL uses)."""
    idx = _check(rewards, group_index)
    r = rewards.to(torch.float64)
    n = _group_sum(torch.ones_like(r), idx)
    return n, _group_sum(r, idx) / n


def _group_all_equal(rewards: Tensor, idx: Tensor) -> Tensor:
    n_groups = int(idx.max().item()) + 1 if idx.numel() else 0
    r = rewards.to(torch.float64)
    hi = torch.full((n_groups,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, idx, r, "amax")
    lo = torch.full((n_groups,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, idx, r, "amin")
    return (hi == lo)[idx]


def grpo_advantages(rewards: Tensor, group_index: Tensor, *, eps: float = 1e-6, unbiased_std: bool = True) -> Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, eq. 3 outcome supervision): A_i = (r_i - mean_g) / (std_g + eps).

    `unbiased_std` uses the sample std (n - 1), as the common implementations do. A group whose rewards
    are all equal (or of size 1) gets advantage exactly 0, even with eps = 0 and rounding in the mean.
    """
    idx = _check(rewards, group_index)
    n, mean = _group_mean(rewards, idx)
    centered = rewards.to(torch.float64) - mean
    var = _group_sum(centered * centered, idx) / ((n - 1).clamp(min=1) if unbiased_std else n)
    adv = centered / (var.sqrt() + eps)
    adv = torch.where(_group_all_equal(rewards, idx), torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype)


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean_g, no std division
    (which biases towards too easy / too hard questions). Pair with `seq-mean-token-sum-norm`."""
    _, mean = _group_mean(rewards, group_index)
    return (rewards.to(torch.float64) - mean).to(rewards.dtype)


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): baseline is the mean reward of the
    *other* samples of the group: A_i = r_i - (sum_g - r_i) / (n_g - 1). Groups of size 1 get 0."""
    n, mean = _group_mean(rewards, group_index)
    r = rewards.to(torch.float64)
    adv = r - (mean * n - r) / (n - 1).clamp(min=1)
    return torch.where(n > 1, adv, torch.zeros_like(adv)).to(rewards.dtype)


def opo_advantages(rewards: Tensor, group_index: Tensor, lengths: Tensor) -> Tensor:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): the length-weighted group
    baseline b_g = sum_i |o_i| r_i / sum_i |o_i|, A_i = r_i - b_g."""
    if lengths.shape != rewards.shape:
        raise ValueError(f"lengths must be [B] like rewards; got {tuple(lengths.shape)}")
    idx = _check(rewards, group_index)
    length = lengths.to(torch.float64)
    baseline = _group_sum(rewards.to(torch.float64) * length, idx) / _group_sum(length, idx).clamp(min=1e-12)
    return (rewards.to(torch.float64) - baseline).to(rewards.dtype)


def to_tokens(seq_advantages: Tensor, mask: Tensor) -> Tensor:
    """Broadcast [B] sequence advantages onto the [B, T] mask (0 where masked)."""
    return seq_advantages[:, None] * mask.to(seq_advantages.dtype)


def last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """[B, T] token rewards with each sequence's scalar reward on its last valid token."""
    m = mask.to(torch.long)
    out = torch.zeros(m.shape, dtype=rewards.dtype, device=rewards.device)
    has = m.sum(-1) > 0
    # index of the last valid token: T-1 - argmax over the reversed mask
    last = m.shape[-1] - 1 - m.flip(-1).argmax(-1)
    out[has, last[has]] = rewards[has]
    return out


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_index: Tensor | None = None,
    token_penalty: Tensor | None = None,
    gamma: float = 1.0,
) -> Tensor:
    """REINFORCE++ (Hu 2025): token rewards (scalar reward on the last token, minus an optional per-token
    KL penalty), discounted returns-to-go, then whitened over all valid tokens of the *batch* (global
    normalisation instead of per-group). With `group_index` the group mean reward is subtracted first
    (the paper's "REINFORCE++-baseline" for reasoning tasks)."""
    r = rewards
    if group_index is not None:
        r = dr_grpo_advantages(rewards, group_index)
    token_r = last_token_rewards(r, mask)
    if token_penalty is not None:
        token_r = token_r - token_penalty.detach() * mask.to(token_r.dtype)
    returns = discounted_returns(token_r, mask, gamma)
    return masked_whiten(returns, mask)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + gamma G_next over valid tokens, where "next" skips masked positions ([B, T]);
    masked positions get 0 and pass the running return through."""
    m = mask.to(token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[-1] - 1, -1, -1):
        running = torch.where(m[:, t] > 0, token_rewards[:, t] + gamma * running, running)
        out[:, t] = running * m[:, t]
    return out


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016): delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l (gamma lam)^l delta_{t+l},
    returns R_t = A_t + V_t. The value after the last valid token is 0 (episode ends). Masked positions
    are skipped (they neither contribute nor break the recursion). Returns (advantages, returns), [B, T]."""
    if values.shape != token_rewards.shape or mask.shape != token_rewards.shape:
        raise ValueError("token_rewards, values and mask must share one [B, T] shape")
    m = mask.to(token_rewards.dtype)
    v = values.detach() * m
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(B, dtype=token_rewards.dtype, device=token_rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in range(T - 1, -1, -1):
        valid = m[:, t]
        delta = token_rewards[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        # a masked position passes the running values through unchanged
        next_adv = torch.where(valid > 0, a, next_adv)
        next_value = torch.where(valid > 0, v[:, t], next_value)
        adv[:, t] = a * valid
    returns = (adv + v) * m
    return adv, returns


def step_rewards_to_tokens(
    step_rewards: Tensor, step_ends: Tensor, num_tokens: int, *, cumulative: bool = True
) -> Tensor:
    """Process (per-step) rewards onto tokens. Step k covers tokens [step_ends[k-1], step_ends[k]).

    `cumulative=True` gives each token the sum of the rewards of its step and every later step
    (DeepSeekMath process supervision, eq. 4: A_t = sum of normalised rewards of steps ending at or
    after t); `cumulative=False` gives each token its own step's reward. Step ends of -1 pad unused
    steps. Returns [B, num_tokens]."""
    if step_rewards.shape != step_ends.shape or step_rewards.dim() != 2:
        raise ValueError("step_rewards and step_ends must both be [B, S]")
    pos = torch.arange(num_tokens, device=step_rewards.device)
    ends = step_ends.to(torch.long)
    starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1].clamp(min=0)], dim=1)
    valid = ends >= 0
    # token t belongs to step k when starts[k] <= t < ends[k]
    inside = (pos[None, None, :] >= starts[:, :, None]) & (pos[None, None, :] < ends[:, :, None]) & valid[:, :, None]
    r = step_rewards * valid.to(step_rewards.dtype)
    if cumulative:
        r = r.flip(-1).cumsum(-1).flip(-1)  # sum over this and later steps
    return (inside.to(r.dtype) * r[:, :, None]).sum(1)


def grpo_process_advantages(
    step_rewards: Tensor, step_ends: Tensor, group_index: Tensor, num_tokens: int, *, eps: float = 1e-6
) -> Tensor:
    """GRPO with process supervision (DeepSeekMath §4.1.3): normalise every step reward by the mean and
    std of all step rewards in the group, then A_t = sum of normalised rewards of steps ending at or after t."""
    valid = step_ends >= 0
    B, S = step_rewards.shape
    flat_r = step_rewards[valid]
    flat_g = group_index[:, None].expand(B, S)[valid]
    norm = torch.zeros_like(step_rewards)
    norm[valid] = grpo_advantages(flat_r, flat_g, eps=eps, unbiased_std=False)
    return step_rewards_to_tokens(norm, step_ends, num_tokens, cumulative=True)


def gpg_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv 2504.02546, eq. 9-10): A_i = alpha (r_i - mean_g), no std division, with
    alpha = B / B_valid, B_valid the samples of groups whose rewards are not all equal. Those groups'
    advantages are 0, so they would otherwise dilute a token-mean gradient; alpha undoes the dilution
    (all groups all-equal: alpha = 1, every advantage 0). Use with the `reinforce` loss (the paper's
    objective is plain policy gradient, token-mean, no ratio clip)."""
    idx = _check(rewards, group_index)
    _, mean = _group_mean(rewards, idx)
    flat = _group_all_equal(rewards, idx)
    n_valid = int((~flat).sum())
    alpha = rewards.numel() / n_valid if n_valid else 1.0
    adv = torch.where(flat, torch.zeros_like(mean), alpha * (rewards.to(torch.float64) - mean))
    return adv.to(rewards.dtype)


def _log_comb(n: Tensor, k: Tensor) -> Tensor:
    """log C(n, k) for float tensors with 0 <= k <= n (the caller masks other entries)."""
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma((n - k).clamp(min=0) + 1)


def passk_advantages(rewards: Tensor, group_index: Tensor, *, k: int, threshold: float = 0.5) -> Tensor:
    """Pass@k advantages (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and
    Exploitation of Large Reasoning Models", arXiv 2508.10751, the analytical derivation): the group's
    expected pass@k over its k-subsets, for binary rewards, with group size n and c correct samples:

        R = 1 - C(n - c, k) / C(n, k),   sigma = sqrt(R (1 - R)),
        A_correct = (1 - R) / sigma,     A_wrong = (1 - R - C(n - c - 1, k - 1) / C(n - 1, k - 1)) / sigma.

    A sample is correct when its reward > `threshold`. k = 1 is GRPO with the population std. A group with
    R in {0, 1} (no sample correct, or fewer than k wrong) gets 0. Every group needs at least k samples."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    idx = _check(rewards, group_index)
    correct = (rewards > threshold).to(torch.float64)
    n = _group_sum(torch.ones_like(correct), idx)
    if bool((n < k).any()):
        raise ValueError(f"pass@{k} advantages need groups of at least {k} samples; the smallest has {int(n.min())}")
    c = _group_sum(correct, idx)
    kk = torch.full_like(n, float(k))
    all_fail = torch.where(n - c >= kk, torch.exp(_log_comb(n - c, kk) - _log_comb(n, kk)), 0.0)
    mean = 1.0 - all_fail
    sigma = (mean * (1.0 - mean)).clamp(min=0).sqrt()
    # share of the k-subsets holding a given wrong sample that are all wrong: they lose the wrong one's credit
    wrong_share = torch.where(n - c - 1 >= kk - 1,
                              torch.exp(_log_comb(n - c - 1, kk - 1) - _log_comb(n - 1, kk - 1)), 0.0)
    adv = torch.where(correct > 0, 1.0 - mean, 1.0 - mean - wrong_share) / sigma.clamp(min=1e-12)
    adv = torch.where(sigma > 1e-12, adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype)


def remax_advantages(rewards: Tensor, group_index: Tensor, baseline: Tensor) -> Tensor:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
    Aligning Large Language Models", arXiv 2310.10505, Algorithm 1): REINFORCE whose baseline is the reward
    of the greedy (argmax) completion of the same prompt, A_i = r_i - r_greedy(g_i), no normalisation.

    `baseline` [B] bool marks the greedy member of each group (exactly one per group, never trained: its
    own advantage is 0). Returns [B] in the rewards' dtype. A group without its greedy member, or with
    two, is an error naming the group index (the rollout did not produce it: see `tidal.core.protocol.
    BASELINE_KEY`)."""
    idx = _check(rewards, group_index)
    if baseline.shape != rewards.shape:
        raise ValueError(f"baseline must be [B] like rewards; got {tuple(baseline.shape)} and {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        return rewards.clone()
    b = baseline.to(torch.bool)
    count = _group_sum(b.to(torch.float64), idx)
    if bool((count != 1).any()):
        g = int(idx[count != 1][0])
        raise ValueError(f"ReMax needs exactly one greedy baseline member per group; group {g} has "
                         f"{int(count[idx == g][0])} (was the group generated with the greedy member? the controller "
                         f"asks for it when the advantage is \"remax\")")
    r = rewards.to(torch.float64)
    greedy = _group_sum(torch.where(b, r, 0.0), idx)  # the one baseline reward of each sample's group
    return torch.where(b, 0.0, r - greedy).to(rewards.dtype)
