"""A uniform face over the advantage estimators, for use by name through the plugin registry.

Each registered estimator is called as ``estimator(batch) -> AdvantageOutputs`` with an
`AdvantageInputs`; the plain functions in tidal.algos.advantages remain the direct API.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
    role_keys: Sequence[str] | None = None  # [B] "<task>/<role>" of each sample (RAE's baselines), e.g. "nim/first"


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


@dataclass(slots=True)
class RoleBaseline:
    """One role key's running statistics: `baseline`, an exponential moving average over batches of the
    key's mean reward; `var`, the variance of that same mixture of batches; `count`, samples seen."""

    baseline: float
    var: float
    count: int


# key -> this rank's rewards of it, in; key -> every data-parallel rank's rewards of it, out
Sync = Callable[[dict[str, list[float]]], dict[str, list[float]]]


class RoleBaselineEstimator:
    """RAE, role-conditioned advantage estimation (registered as "rae"; SPIRAL, Liu et al. 2025, arXiv
    2506.24119): A = r - b(key), b a running baseline per role key (`AdvantageInputs.role_keys`,
    "<task>/<role>"), broadcast to tokens. In zero-sum self-play both seats of a game share a group whose
    mean reward (GRPO's baseline) is 0 by construction, and a seat's structural edge (the first player's)
    would be credited to its moves; a baseline per environment and role removes both.

    Per batch: every advantage from the baselines as they were before the batch (a sample's reward never
    enters its own baseline), then each key's baseline moves once towards the key's mean reward in the
    batch, b <- decay * b + (1 - decay) * mean (SPIRAL's update). A batch mean, not one update per sample:
    the result does not depend on the order of the samples, nor on how data-parallel ranks split them.
    A key seen for the first time starts at its batch's mean (its first advantages are r - mean, Dr.GRPO
    over the key): a start at 0 would lag a key whose mean reward is not 0 (the first player's, a 0/1
    reward) for about 1 / (1 - decay) batches (at 0.95 half the gap is left after 14), and all that key's
    advantages would share one sign meanwhile.

    `normalize`: A / (std + 1e-6), with the key's running std (`RoleBaseline.var`, law of total variance
    over the same mixture) taken after the batch: it holds the batch's own spread, so a reward unlike any
    the key has had is not divided by a near-zero std (|A| <= sqrt(2n / (1 - decay) + 2 / (decay (1 -
    decay))) for a key's n samples). It needs decay > 0 (with 0 the std is the batch's own alone).

    Stateful: `state_dict()` / `load_state_dict()` (JSON-able) for checkpoints. `sync`, set by a learner
    with several data-parallel ranks, gathers each key's rewards from every rank's share, so that each rank
    updates the same baselines from the whole batch. A non-finite reward updates nothing (its advantage
    is not finite: the learner skips such a step)."""

    uses_role_keys = True  # the learner hands it AdvantageInputs.role_keys (Sample.role_key)
    eps = 1e-6

    def __init__(self, decay: float = 0.95, normalize: bool = False) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if normalize and decay == 0.0:
            raise ValueError("normalize needs decay > 0: with decay 0 the std is the last batch's alone, 0 when a "
                             "key's rewards in it are all equal, and its advantages would be divided by 1e-6")
        self.decay, self.normalize = decay, normalize
        self.keys: dict[str, RoleBaseline] = {}
        self.sync: Sync | None = None

    def __call__(self, batch: AdvantageInputs) -> AdvantageOutputs:
        keys = batch.role_keys
        if keys is None:
            raise ValueError("advantage estimator 'rae' needs AdvantageInputs.role_keys, one \"<task>/<role>\" per "
                             "sample: these samples carry no role. RAE is for multi-role (self-play) episodes, whose "
                             "samples carry metadata tidal.role; use \"grpo\" for single-role ones")
        rewards = batch.rewards.tolist()
        if len(keys) != len(rewards):
            raise ValueError(f"role_keys must hold one key per sample: {len(keys)} keys for {len(rewards)} rewards")
        mine: dict[str, list[float]] = {}
        for key, r in zip(keys, rewards, strict=True):
            if math.isfinite(r):
                mine.setdefault(key, []).append(r)
        stats = {key: _mean_var(rs) for key, rs in (self.sync(mine) if self.sync else mine).items() if rs}
        for key, (mean, var, _) in stats.items():
            self.keys.setdefault(key, RoleBaseline(mean, var, 0))  # first seen: its batch's statistics
        before = [self.keys[k].baseline if k in self.keys else math.nan for k in keys]
        seq = batch.rewards.to(torch.float64) - torch.tensor(before, dtype=torch.float64, device=batch.rewards.device)
        d = self.decay
        for key, (mean, var, n) in stats.items():
            s = self.keys[key]
            s.var = d * s.var + (1 - d) * var + d * (1 - d) * (mean - s.baseline) ** 2
            s.baseline = d * s.baseline + (1 - d) * mean
            s.count += n
        if self.normalize:
            std = [math.sqrt(self.keys[k].var) if k in self.keys else math.nan for k in keys]
            seq = seq / (torch.tensor(std, dtype=torch.float64, device=seq.device) + self.eps)
        return AdvantageOutputs(advantages=adv.to_tokens(seq.to(batch.rewards.dtype), batch.mask))

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """key -> {baseline, var, count}: plain numbers, for a checkpoint's JSON."""
        return {k: {"baseline": s.baseline, "var": s.var, "count": s.count} for k, s in sorted(self.keys.items())}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        keys = {}
        for key, s in state.items():
            try:
                keys[key] = RoleBaseline(float(s["baseline"]), float(s["var"]), int(s["count"]))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"RAE state of key {key!r} must be {{baseline, var, count}}, got {s!r}") from e
        self.keys = keys


def _mean_var(values: list[float]) -> tuple[float, float, int]:
    """(mean, population variance, n), summed exactly (math.fsum): the same for any order of `values`."""
    n = len(values)
    mean = math.fsum(values) / n
    return mean, math.fsum((v - mean) ** 2 for v in values) / n, n
