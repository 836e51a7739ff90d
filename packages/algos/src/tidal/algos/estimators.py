"""A uniform face over the advantage estimators, for use by name through the plugin registry.

Each registered estimator is called as ``estimator(batch) -> AdvantageOutputs`` with an
`AdvantageInputs`; the plain functions in tidal.algos.advantages remain the direct API.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tidal.algos import advantages as adv
from tidal.algos.offpolicy import oapl_advantages


@dataclass(kw_only=True, slots=True)
class AdvantageInputs:
    rewards: Tensor  # [B] scalar reward per sequence
    mask: Tensor  # [B, T] completion tokens that are trained on
    group_index: Tensor | None = None  # [B] group (prompt) of each sample
    values: Tensor | None = None  # [B, T] critic values (GAE)
    token_rewards: Tensor | None = None  # [B, T] per-token rewards; default: reward on the last token
    token_penalty: Tensor | None = None  # [B, T] per-token penalty (e.g. beta * KL), subtracted
    step_rewards: Tensor | None = None  # [B, S] process rewards
    step_ends: Tensor | None = None  # [B, S] end (exclusive) token of each step, -1 = unused
    baseline: Tensor | None = None  # [B] bool: the greedy member of its group, not trained (ReMax's baseline)


@dataclass(kw_only=True, slots=True)
class AdvantageOutputs:
    advantages: Tensor  # [B, T]
    returns: Tensor | None = None  # [B, T] value targets (GAE only)


def _need(batch: AdvantageInputs, name: str, who: str) -> Tensor:
    value = getattr(batch, name)
    if value is None:
        raise ValueError(f"advantage estimator {who!r} needs AdvantageInputs.{name}")
    return value


class GroupEstimator:
    """GRPO / Dr.GRPO / RLOO / OPO: a sequence advantage from the outcome reward of each sample, normalised
    in its group, broadcast to tokens. Process (step) rewards are not read: `ProcessEstimator` does."""

    def __init__(self, kind: str, eps: float = 1e-6, unbiased_std: bool = True) -> None:
        if kind not in ("grpo", "dr_grpo", "rloo", "opo"):
            raise ValueError(f"unknown group estimator {kind!r}")
        if kind != "grpo" and (eps != 1e-6 or not unbiased_std):
            raise ValueError(f"{kind} does not divide by the group's std: eps and unbiased_std (GRPO's) would "
                             f"change nothing; leave them out")
        self.kind, self.eps, self.unbiased_std = kind, eps, unbiased_std

    def __call__(self, batch: AdvantageInputs) -> AdvantageOutputs:
        g = _need(batch, "group_index", self.kind)
        if self.kind == "grpo":
            seq = adv.grpo_advantages(batch.rewards, g, eps=self.eps, unbiased_std=self.unbiased_std)
        elif self.kind == "dr_grpo":
            seq = adv.dr_grpo_advantages(batch.rewards, g)
        elif self.kind == "rloo":
            seq = adv.rloo_advantages(batch.rewards, g)
        else:
            seq = adv.opo_advantages(batch.rewards, g, batch.mask.sum(-1))
        return AdvantageOutputs(advantages=adv.to_tokens(seq, batch.mask))


class ProcessEstimator:
    """GRPO with process supervision beside the outcome (registered as "grpo_process"): each step reward is
    normalised over all step rewards of its group and credited to the tokens of its step and the steps
    before it (reward-to-go, `grpo_process_advantages`); the outcome reward is normalised in its group as
    in GRPO. A_t = outcome_weight * A_outcome + step_weight * A_process_t, masked to the trained tokens.
    Samples without steps (step_ends all -1) get the outcome part only. Outcome and step rewards reach
    this point separately (Trajectory.reward, .step_rewards at .step_ends)."""

    uses_step_rewards = True  # the learner hands it Trajectory.step_rewards / step_ends

    def __init__(self, outcome_weight: float = 1.0, step_weight: float = 1.0, eps: float = 1e-6) -> None:
        self.outcome_weight, self.step_weight, self.eps = outcome_weight, step_weight, eps

    def __call__(self, batch: AdvantageInputs) -> AdvantageOutputs:
        g = _need(batch, "group_index", "grpo_process")
        mask = batch.mask.to(torch.float32)
        a = self.outcome_weight * adv.to_tokens(adv.grpo_advantages(batch.rewards, g, eps=self.eps), batch.mask)
        if batch.step_rewards is not None and self.step_weight:
            ends = _need(batch, "step_ends", "grpo_process")
            proc = adv.grpo_process_advantages(batch.step_rewards, ends, g, batch.mask.shape[-1], eps=self.eps)
            a = a + self.step_weight * proc * mask
        return AdvantageOutputs(advantages=a)


class ReinforcePPEstimator:
    def __init__(self, gamma: float = 1.0, group_baseline: bool = False) -> None:
        self.gamma, self.group_baseline = gamma, group_baseline

    def __call__(self, batch: AdvantageInputs) -> AdvantageOutputs:
        g = _need(batch, "group_index", "reinforce_pp (group_baseline)") if self.group_baseline else None
        a = adv.reinforce_pp_advantages(
            batch.rewards, batch.mask, group_index=g, token_penalty=batch.token_penalty, gamma=self.gamma
        )
        return AdvantageOutputs(advantages=a)


class GAEEstimator:
    needs_values = True  # reads a critic's per-token values: the learner trains a value head

    def __init__(self, gamma: float = 1.0, lam: float = 0.95) -> None:
        self.gamma, self.lam = gamma, lam

    def __call__(self, batch: AdvantageInputs) -> AdvantageOutputs:
        values = _need(batch, "values", "gae")
        r = batch.token_rewards if batch.token_rewards is not None else adv.last_token_rewards(batch.rewards, batch.mask)
        if batch.token_penalty is not None:
            r = r - batch.token_penalty.detach()
        a, ret = adv.gae_advantages(r, values, batch.mask, gamma=self.gamma, lam=self.lam)
        return AdvantageOutputs(advantages=a, returns=ret)


class OAPLEstimator:
    """OAPL's advantage (registered as "oapl"): A_i = r_i - V*_g, V*_g = beta * log mean_g exp(r / beta)
    (`tidal.algos.offpolicy.oapl_advantages`; `beta` is the paper's beta_1), broadcast to tokens. The
    loss "oapl" needs it; with another policy-gradient loss it is a soft-max group baseline, between
    Dr.GRPO's mean (large beta) and the group's best reward (small beta)."""

    def __init__(self, beta: float = 1.0) -> None:
        if beta <= 0:
            raise ValueError(f"beta (OAPL's beta_1) must be > 0, got {beta}")
        self.beta = beta

    def __call__(self, batch: AdvantageInputs) -> AdvantageOutputs:
        g = _need(batch, "group_index", "oapl")
        return AdvantageOutputs(advantages=adv.to_tokens(oapl_advantages(batch.rewards, g, self.beta), batch.mask))


class GPGEstimator:
    """GPG (registered as "gpg"): r - group mean, no std, scaled by B / B_valid (`gpg_advantages`).
    Pair with the `reinforce` loss, as the paper does."""

    def __call__(self, batch: AdvantageInputs) -> AdvantageOutputs:
        seq = adv.gpg_advantages(batch.rewards, _need(batch, "group_index", "gpg"))
        return AdvantageOutputs(advantages=adv.to_tokens(seq, batch.mask))


class PassKEstimator:
    """Pass@k training's analytical advantages (registered as "passk", `passk_advantages`): rewards
    above `threshold` count as correct; every group needs at least `k` samples."""

    def __init__(self, k: int = 2, threshold: float = 0.5) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k, self.threshold = k, threshold

    def __call__(self, batch: AdvantageInputs) -> AdvantageOutputs:
        g = _need(batch, "group_index", "passk")
        seq = adv.passk_advantages(batch.rewards, g, k=self.k, threshold=self.threshold)
        return AdvantageOutputs(advantages=adv.to_tokens(seq, batch.mask))


class ReMaxEstimator:
    """ReMax (registered as "remax", `remax_advantages`): A_i = r_i - r of its group's greedy completion,
    broadcast to tokens. Each group carries one greedy member that is scored but never trained: the
    learner hands the members to this estimator (`greedy_baseline`) and trains on the others. With
    `group_size = G` a group is G - 1 sampled completions and the greedy one. Pair with `reinforce` (the
    paper's objective) or a clipped loss."""

    greedy_baseline = True  # the rollout adds a greedy member to each group; the learner trains the others

    def __call__(self, batch: AdvantageInputs) -> AdvantageOutputs:
        g = _need(batch, "group_index", "remax")
        seq = adv.remax_advantages(batch.rewards, g, _need(batch, "baseline", "remax"))
        return AdvantageOutputs(advantages=adv.to_tokens(seq, batch.mask))
