"""Importance-sampling correction between the behaviour policy (the sampler's logprobs) and the learner.

Each policy maps a `CorrectionInputs` to a `Correction`: per-token weights and a per-token mask to put
into tidal-algos' `LossInputs` (`is_weights`, and `mask &= correction.mask`). Policies compose with
`combine` (weights multiply, masks AND). Everything here runs without gradient.

With behaviour == learner logprobs every policy is the identity: weights 1, nothing masked.

Every weight starts from `_log_ratio`, clamped to +-LOG_RATIO_BOUND (20: exp(20) ~ 4.9e8, far beyond any
cap in use) and set to 0 at masked positions with `torch.where`, so a -inf behaviour logprob at a padded
position, or a ratio of e^1000, gives finite weights. (tidal-algos' `tidal.algos.ratio` does the same;
this package does not import it.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tidal.staleness import config as C

log = logging.getLogger("tidal.staleness")


@dataclass(kw_only=True, slots=True)
class CorrectionInputs:
    learner_logprobs: Tensor  # [B, T] learner's logprobs of the sampled tokens (no grad): the target policy
    behaviour_logprobs: Tensor  # [B, T] logprobs the sampler drew with
    mask: Tensor  # [B, T] bool: real completion tokens
    advantages: Tensor | None = None  # [B, T] or [B]; needed by OffPolicySequenceMask
    proximal_logprobs: Tensor | None = None  # [B, T] decoupled PPO's proximal policy
    # [B, T] int: the learner's version minus the oldest version in the KV cache each token attended to
    # when sampled (Trajectory.kv_versions); None = no producer recorded it. Read by KVLagMask
    kv_lag: Tensor | None = None

    def __post_init__(self) -> None:
        ref = self.learner_logprobs
        for name in ("behaviour_logprobs", "mask", "proximal_logprobs", "kv_lag"):
            v = getattr(self, name)
            if v is not None and v.shape != ref.shape:
                raise ValueError(f"CorrectionInputs.{name} has shape {tuple(v.shape)}, learner_logprobs {tuple(ref.shape)}")
        if ref.dim() != 2:
            raise ValueError(f"CorrectionInputs.learner_logprobs must be [batch, tokens], got {tuple(ref.shape)}")


@dataclass(kw_only=True, slots=True)
class Correction:
    weights: Tensor  # [B, T] multiply per-token losses by these (1 where no correction)
    mask: Tensor  # [B, T] bool: False = drop this token from the loss
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached 0-d tensors


LOG_RATIO_BOUND = 20.0


def _log_ratio(inp: CorrectionInputs) -> Tensor:
    target = inp.proximal_logprobs if inp.proximal_logprobs is not None else inp.learner_logprobs
    lr = (target - inp.behaviour_logprobs).detach().float().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.where(inp.mask.bool(), lr, 0.0)  # where: -inf - -inf is NaN, which a product keeps


def _seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return torch.where(mask.bool(), x, 0.0).sum(-1) / m.sum(-1).clamp(min=1)


def _frac(flags: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(torch.float32)
    return (flags.to(torch.float32) * m).sum() / m.sum().clamp(min=1)


def _seq_frac(flags: Tensor, mask: Tensor) -> Tensor:
    has = mask.any(-1)
    return (flags & has).sum().to(torch.float32) / has.sum().clamp(min=1).to(torch.float32)


class TokenTIS:
    """Token-level truncated IS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): w_t = min(pi_learner(t) / pi_sampler(t), C). Use when sampler and learner
    differ numerically (vLLM vs FSDP kernels, fp8 rollouts) or by a few versions."""

    def __init__(self, cap: float = 2.0) -> None:
        self.cap = cap

    def __call__(self, inp: CorrectionInputs) -> Correction:
        ratio = _log_ratio(inp).exp()
        w = ratio.clamp(max=self.cap)
        return Correction(weights=w * inp.mask, mask=inp.mask.bool(),
                          metrics={"is/token_truncated_frac": _frac(ratio > self.cap, inp.mask)})


class SequenceTIS:
    """Sequence-level truncated IS: one weight per sequence, the geometric mean of its token ratios,
    min(exp(mean_t log ratio), C), on every token. Lower variance than the product of ratios; use with
    sequence-level objectives (GSPO) or when per-token weights are too noisy."""

    def __init__(self, cap: float = 2.0) -> None:
        self.cap = cap

    def __call__(self, inp: CorrectionInputs) -> Correction:
        seq_ratio = _seq_mean(_log_ratio(inp), inp.mask).exp()
        w = seq_ratio.clamp(max=self.cap)
        weights = w[:, None].expand_as(inp.learner_logprobs) * inp.mask
        return Correction(weights=weights, mask=inp.mask.bool(),
                          metrics={"is/seq_truncated_frac": _seq_frac(seq_ratio > self.cap, inp.mask)})


class MaskedIS:
    """Masked IS ("MIS"): instead of reweighting, drop tokens (or whole sequences, by geometric-mean
    ratio) whose ratio falls outside [low, high]. Use when large mismatches mean broken samples (e.g. a
    kernel bug, a stale prefix) that should not be trained on at all.

    `level="sequence"` is the geometric-mean sequence rejection: a sequence is dropped whole when
    exp(mean_t log(pi_learner / pi_sampler)) leaves [low, high]. It is the sequence-level masked IS of
    the MIS line of work (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
    RL Training", and its follow-ups) with the length-normalised ratio that GSPO (Zheng et al. 2025,
    arXiv 2507.18071) clips, known as "geometric sequence masking" (TRL's
    `sequence_geometric_mean_mask`, 2026). Unlike the product of ratios it does not favour short
    sequences. Use it rather than a separate correction."""

    def __init__(self, low: float = 0.5, high: float = 2.0, level: str = "token") -> None:
        if not 0 <= low < 1 < high:
            raise ValueError(f"need 0 <= low < 1 < high, got low={low}, high={high}")
        if level not in ("token", "sequence"):
            raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
        self.low, self.high, self.level = low, high, level

    def __call__(self, inp: CorrectionInputs) -> Correction:
        mask = inp.mask.bool()
        if self.level == "token":
            r = _log_ratio(inp).exp()
            keep = (r >= self.low) & (r <= self.high)
            out = mask & keep
            metrics = {"is/token_masked_frac": _frac(~keep, mask)}
        else:
            s = _seq_mean(_log_ratio(inp), mask).exp()
            keep_seq = (s >= self.low) & (s <= self.high)
            out = mask & keep_seq[:, None]
            metrics = {"is/seq_masked_frac": _seq_frac(~keep_seq, mask)}
        return Correction(weights=out.to(torch.float32), mask=out, metrics=metrics)


class IcePop:
    """IcePop (inclusionAI 2025, "Small Leak Can Sink a Great Ship: Boost RL Training on MoE with IcePop",
    the Ring-1T report, arXiv 2510.18855): token-level training-inference mismatch correction with
    k_t = pi_learner(t) / pi_sampler(t): the token keeps weight k_t where low <= k_t <= high, else it is
    masked out of the gradient (weight 0, mask False). Unlike TIS it does not keep a capped weight on a
    token whose probabilities disagree by more than the band: such tokens (MoE routing flips, kernel
    differences compounding over long outputs) are dropped. Paper defaults: 0.5 and 5."""

    def __init__(self, low: float = 0.5, high: float = 5.0) -> None:
        if not 0 <= low < 1 < high:
            raise ValueError(f"need 0 <= low < 1 < high, got low={low}, high={high}")
        self.low, self.high = low, high

    def __call__(self, inp: CorrectionInputs) -> Correction:
        mask = inp.mask.bool()
        k = _log_ratio(inp).exp()
        inside = (k >= self.low) & (k <= self.high)  # False for NaN: a broken token is dropped too
        out = mask & inside
        # where(), not a product: k may be inf at a masked position with a -inf sampler logprob
        weights = torch.where(out, k, torch.zeros_like(k))
        return Correction(weights=weights, mask=out, metrics={"is/icepop_masked_frac": _frac(~inside, mask)})


class OffPolicySequenceMask:
    """Off-policy sequence masking (DeepSeek-V3.2 report): mask a sequence when its mean mismatch KL
    (k3 of sampler vs learner) exceeds `delta` *and* its advantage is negative — pushing down a sample
    the current policy would not produce is the update most likely to destabilise training."""

    def __init__(self, delta: float = 1e-3) -> None:
        self.delta = delta

    def __call__(self, inp: CorrectionInputs) -> Correction:
        if inp.advantages is None:
            raise ValueError("OffPolicySequenceMask needs CorrectionInputs.advantages")
        mask = inp.mask.bool()
        # k3 of KL(sampler || learner) from sampler samples: r = pi_learner / pi_sampler
        lr = _log_ratio(inp)
        kl = _seq_mean(torch.expm1(lr) - lr, mask)
        adv = inp.advantages.detach().float()
        seq_adv = _seq_mean(adv, mask) if adv.dim() == 2 else adv
        drop = (kl > self.delta) & (seq_adv < 0)
        out = mask & ~drop[:, None]
        return Correction(weights=out.to(torch.float32), mask=out,
                          metrics={"is/offpolicy_seq_masked_frac": _seq_frac(drop, mask)})


class DecoupledPPO:
    """AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL"): the PPO ratio is taken against a
    *proximal* policy (the learner's logprobs before this update: pass them as `old_logprobs` to the
    loss), and the behaviour mismatch is corrected by the weight pi_prox / pi_behav, optionally truncated.
    Use with stale rollouts: it keeps the trust region around a recent policy, not the stale sampler."""

    needs_proximal = True  # the learner passes its pre-update logprobs (CorrectionInputs.proximal_logprobs)

    def __init__(self, cap: float | None = None) -> None:
        self.cap = cap

    def __call__(self, inp: CorrectionInputs) -> Correction:
        if inp.proximal_logprobs is None:
            raise ValueError("DecoupledPPO needs CorrectionInputs.proximal_logprobs (the learner's pre-update logprobs)")
        w = _log_ratio(inp).exp()
        metrics = {}
        if self.cap is not None:
            metrics["is/behav_truncated_frac"] = _frac(w > self.cap, inp.mask)
            w = w.clamp(max=self.cap)
        return Correction(weights=w * inp.mask, mask=inp.mask.bool(), metrics=metrics)


class KVLagMask:
    """Mask tokens sampled over a stale KV cache: a token whose KV cache (the oldest entry it attended to,
    `CorrectionInputs.kv_lag`) is more than `max_kv_lag` versions behind the learner leaves the loss. With
    in-flight updates in partial mode "continue" a token sampled by a recent version may still attend to
    keys/values written by much older weights (the prompt's and the earliest tokens'), a mismatch the
    token's own version (and so version rejection) does not show. Without kv_lag (no producer recorded
    `Trajectory.kv_versions`) it changes nothing, and says so once."""

    def __init__(self, max_kv_lag: int = 4) -> None:
        if max_kv_lag < 0:
            raise ValueError(f"max_kv_lag must be >= 0, got {max_kv_lag}")
        self.max_kv_lag = max_kv_lag
        self._said_missing = False

    def __call__(self, inp: CorrectionInputs) -> Correction:
        mask = inp.mask.bool()
        if inp.kv_lag is None:
            if not self._said_missing:
                self._said_missing = True
                log.warning("correction kv_lag_mask: the samples carry no kv_versions (their engine did not "
                            "record them): nothing is masked")
            return Correction(weights=mask.to(torch.float32), mask=mask)
        stale = inp.kv_lag > self.max_kv_lag
        out = mask & ~stale
        return Correction(weights=out.to(torch.float32), mask=out,
                          metrics={"is/kv_lag_masked_frac": _frac(stale, mask)})


def combine(inp: CorrectionInputs, policies: list) -> Correction:
    """Apply several policies: weights multiply, masks AND, metrics merge."""
    weights = inp.mask.to(torch.float32).clone()
    mask = inp.mask.bool().clone()
    metrics: dict[str, Tensor] = {}
    for policy in policies:
        c = policy(inp)
        weights = weights * c.weights
        mask = mask & c.mask
        metrics.update(c.metrics)
    return Correction(weights=weights * mask, mask=mask, metrics=metrics)


FACTORIES = {
    "tis": (TokenTIS, C.TokenTISConfig),
    "seq_tis": (SequenceTIS, C.SequenceTISConfig),
    "masked_is": (MaskedIS, C.MaskedISConfig),
    "off_policy_seq_mask": (OffPolicySequenceMask, C.OffPolicySequenceMaskConfig),
    "decoupled_ppo": (DecoupledPPO, C.DecoupledPPOConfig),
    "icepop": (IcePop, C.IcePopConfig),
    "kv_lag_mask": (KVLagMask, C.KVLagMaskConfig),
}
