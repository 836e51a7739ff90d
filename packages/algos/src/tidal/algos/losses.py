"""Policy losses: each takes a `LossInputs` and returns a `LossOutputs` (scalar loss + detached metrics).

All share the options `agg` (see tidal.algos.aggregation), `kl_coef`/`kl_estimator` (KL to
`ref_logprobs` as a loss term), `entropy_coef` (bonus on `entropy`), and multiply per-token terms by
`is_weights` when tidal-staleness supplies them. The ratio is taken against `old_logprobs` when given
(decoupled PPO's proximal policy), else against the sampler's `behaviour_logprobs`.

NaN safety: every log-ratio comes from `tidal.algos.ratio.log_ratio` (clamped to +-20, 0 at masked
positions) and every reduction masks with `torch.where`, so a -inf or NaN at a masked position (a padded
behaviour logprob, a teacher's unsupported token) reaches neither the loss nor its gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algos.aggregation import aggregate, masked_mean
from tidal.algos.kl import kl_estimate
from tidal.algos.ratio import log_ratio as _log_ratio
from tidal.algos.types import LossInputs, LossOutputs, require


def _finish(
    per_token: Tensor,
    inputs: LossInputs,
    metrics: dict[str, Tensor],
    *,
    agg: str,
    kl_coef: float,
    kl_estimator: str,
    entropy_coef: float,
    norm_length: float | None,
) -> LossOutputs:
    """Apply IS weights, aggregate, add KL and entropy terms, and fill the shared metrics."""
    metrics.pop("_n", None)
    metrics.pop("_inv", None)
    mask = inputs.mask
    if inputs.is_weights is not None:
        # where, not a product alone: a weight that is NaN at a masked position would poison the gradient
        per_token = per_token * torch.where(mask.bool(), inputs.is_weights.detach(), 0.0)
    loss = aggregate(per_token, mask, agg, norm_length)
    metrics["loss/policy"] = loss.detach()
    if kl_coef:
        ref = require(inputs, "ref_logprobs", f"kl_coef={kl_coef}")
        kl = kl_estimate(inputs.logprobs, ref.detach(), kl_estimator)
        kl_term = aggregate(kl, mask, agg, norm_length)
        loss = loss + kl_coef * kl_term
        metrics["kl/ref"] = kl_term.detach()
    elif inputs.ref_logprobs is not None:
        metrics["kl/ref"] = masked_mean(kl_estimate(inputs.logprobs.detach(), inputs.ref_logprobs, "k3"), mask)
    if inputs.entropy is not None:
        ent = aggregate(inputs.entropy, mask, agg, norm_length)
        metrics["entropy"] = ent.detach()
        if entropy_coef:
            loss = loss - entropy_coef * ent
    metrics["loss/total"] = loss.detach()
    return LossOutputs(loss=loss, metrics=metrics)


@torch.no_grad()
def _ratio_metrics(log_ratio: Tensor, mask: Tensor, ratio: Tensor | None = None) -> dict[str, Tensor]:
    """Ratio mean/max/min and the "approx KL" (k3, and k1 as `kl/approx_k1`) over the valid tokens. Each full-size temporary costs
    about as much as the loss's own arithmetic, so they are kept few: the float mask and its count once,
    the ratio reused when the loss already has it, max and min over one masked copy each."""
    lr = log_ratio.detach()
    m = mask.bool()
    ratio = lr.exp() if ratio is None else ratio.detach()
    mf = m.to(ratio.dtype)
    n = mf.sum()
    inv = 1.0 / n.clamp(min=1)
    valid = n > 0
    zero = ratio.new_zeros(())
    return {
        "ratio/mean": (ratio * mf).sum() * inv,
        "ratio/max": torch.where(valid, torch.where(m, ratio, -torch.inf).max(), zero),
        "ratio/min": torch.where(valid, torch.where(m, ratio, torch.inf).min(), zero),
        # k3 estimate of KL(anchor || current) from anchor samples: the "approx KL" PPO logs (expm1: exact
        # near ratio 1, where ratio - 1 would cancel)
        "kl/approx": ((torch.expm1(lr) - lr) * mf).sum() * inv,
        # k1 of the same KL, mean(-log r): what verl logs as `actor/ppo_kl` (noisier, can be negative)
        "kl/approx_k1": -(lr * mf).sum() * inv,
        "_n": n, "_inv": inv,  # shared with the caller's clip fractions, removed before returning
    }


def _advantages(inputs: LossInputs) -> Tensor:
    """The detached advantages, 0 at masked positions (with `torch.where`: a NaN there, times a zero
    gradient, would still be NaN in the backward pass)."""
    return torch.where(inputs.mask.bool(), inputs.advantages.detach(), 0.0)


def _fraction(hit: Tensor, mask: Tensor, metrics: dict[str, Tensor]) -> Tensor:
    """Share of valid tokens where `hit` (bool) holds."""
    return (hit & mask.bool()).sum().to(metrics["_inv"].dtype) * metrics["_inv"]


def ppo_loss(
    inputs: LossInputs,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    norm_length: float | None = None,
) -> LossOutputs:
    """PPO clipped surrogate, token level (Schulman et al. 2017, eq. 7):
    L_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), r_t = pi/pi_anchor.

    `clip_high > clip_low` is DAPO's clip-higher (Yu et al. 2025; 0.2 / 0.28). `dual_clip = c > 1`
    bounds the loss of negative-advantage tokens by c |A| (Ye et al. 2020, "Mastering Complex Control in
    MOBA Games"), so a huge ratio cannot blow the update up. Where the clip is active the gradient is 0.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (typically 3), got {dual_clip}")
    log_ratio = _log_ratio(inputs.logprobs, inputs.anchor_logprobs, inputs.mask)
    ratio = log_ratio.exp()
    adv = _advantages(inputs)
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(surr1, surr2)
    mask = inputs.mask
    metrics = _ratio_metrics(log_ratio, mask, ratio)
    r = ratio.detach()
    metrics["clip/high"] = _fraction((r > 1 + clip_high) & (adv > 0), mask, metrics)
    metrics["clip/low"] = _fraction((r < 1 - clip_low) & (adv < 0), mask, metrics)
    if dual_clip is not None:
        bound = -dual_clip * adv  # positive for negative advantages
        dual = (adv < 0) & (per_token.detach() > bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
        metrics["clip/dual"] = _fraction(dual, mask, metrics)
    return _finish(per_token, inputs, metrics, agg=agg, kl_coef=kl_coef, kl_estimator=kl_estimator,
                   entropy_coef=entropy_coef, norm_length=norm_length)


def gspo_loss(
    inputs: LossInputs,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    norm_length: float | None = None,
    clip_frac: str = "sequence",
) -> LossOutputs:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): a sequence-level, length-normalised
    ratio s_i = exp(mean_t log(pi/pi_anchor)) clipped as in PPO: L_i = -min(s_i A_i, clip(s_i) A_i).

    Implemented in the paper's GSPO-token form, s_{i,t} = sg[s_i] * pi_t / sg[pi_t], which has the same
    value and gradient as the sequence form when A is constant over a sequence and also accepts per-token
    advantages. Clip ranges are tiny because s_i is a geometric mean (paper: 3e-4 / 4e-4).

    `clip_frac` changes only the logged clip/high and clip/low: "sequence" = the share of sequences whose
    s_i is clipped; "token" = the share of valid tokens in such sequences (a long sequence counts more),
    as verl's GSPO `pg_clipfrac` is taken.
    """
    if clip_frac not in ("sequence", "token"):
        raise ValueError(f"clip_frac must be 'sequence' or 'token', got {clip_frac!r}")
    mask = inputs.mask
    m = mask.to(inputs.logprobs.dtype)
    log_ratio = _log_ratio(inputs.logprobs, inputs.anchor_logprobs, mask)  # 0 where masked: the sum is safe
    seq_log_ratio = log_ratio.detach().sum(-1) / m.sum(-1).clamp(min=1)  # [B]
    token_ratio = torch.exp(seq_log_ratio[:, None] + inputs.logprobs - inputs.logprobs.detach())
    adv = _advantages(inputs)
    surr1 = token_ratio * adv
    surr2 = token_ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(surr1, surr2)
    metrics = _ratio_metrics(log_ratio, mask)
    s = seq_log_ratio.exp()
    has = m.sum(-1) > 0
    seq_adv = torch.where(mask.bool(), adv, 0.0).sum(-1) / m.sum(-1).clamp(min=1)
    n = has.sum().clamp(min=1).to(s.dtype)
    high, low = (s > 1 + clip_high) & (seq_adv > 0) & has, (s < 1 - clip_low) & (seq_adv < 0) & has
    if clip_frac == "token":  # each sequence weighted by its valid tokens
        metrics["clip/high"] = _fraction(high[:, None].expand_as(mask), mask, metrics)
        metrics["clip/low"] = _fraction(low[:, None].expand_as(mask), mask, metrics)
    else:
        metrics["clip/high"] = high.to(s.dtype).sum() / n
        metrics["clip/low"] = low.to(s.dtype).sum() / n
    metrics["ratio/seq_mean"] = (s * has).sum() / n
    return _finish(per_token, inputs, metrics, agg=agg, kl_coef=kl_coef, kl_estimator=kl_estimator,
                   entropy_coef=entropy_coef, norm_length=norm_length)


def cispo_loss(
    inputs: LossInputs,
    *,
    clip_low: float | None = None,
    clip_high: float = 0.28,
    agg: str = "token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    norm_length: float | None = None,
) -> LossOutputs:
    """CISPO (MiniMax 2025, "MiniMax-M1", eq. 4): clip the importance weight, not the update:
    L_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t log pi_t, token-mean over the batch.

    Every token keeps a gradient (scaled by the clipped weight), so rare "fork" tokens with large
    ratios still learn. The paper tunes only the upper bound and leaves the lower one open:
    `clip_low=None` means no lower bound.
    """
    log_ratio = _log_ratio(inputs.logprobs, inputs.anchor_logprobs, inputs.mask)
    r = log_ratio.detach().exp()
    lower = 0.0 if clip_low is None else 1.0 - clip_low
    weight = r.clamp(lower, 1.0 + clip_high)
    adv = _advantages(inputs)
    per_token = -weight * adv * inputs.logprobs
    mask = inputs.mask
    metrics = _ratio_metrics(log_ratio, mask, r)
    metrics["clip/high"] = _fraction(r > 1 + clip_high, mask, metrics)
    metrics["clip/low"] = _fraction(r < lower, mask, metrics)
    return _finish(per_token, inputs, metrics, agg=agg, kl_coef=kl_coef, kl_estimator=kl_estimator,
                   entropy_coef=entropy_coef, norm_length=norm_length)


def reinforce_loss(
    inputs: LossInputs,
    *,
    agg: str = "token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    norm_length: float | None = None,
) -> LossOutputs:
    """REINFORCE (Williams 1992): L_t = -A_t log pi_t. Off-policy samples are reweighted only through
    `is_weights` (from tidal-staleness); there is no ratio clipping."""
    per_token = -_advantages(inputs) * inputs.logprobs
    metrics = _ratio_metrics(_log_ratio(inputs.logprobs, inputs.anchor_logprobs, inputs.mask), inputs.mask)
    return _finish(per_token, inputs, metrics, agg=agg, kl_coef=kl_coef, kl_estimator=kl_estimator,
                   entropy_coef=entropy_coef, norm_length=norm_length)


def distillation_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025): the per-token negative
    reverse KL, A_t = log p_teacher(x_t) - log p_student(x_t), on the student's own samples."""
    # where, not a product: the teacher's logprob is -inf at a token outside its support (masked)
    return torch.where(mask.bool(), (teacher_logprobs - student_logprobs).detach(), 0.0)


def distillation_loss(
    inputs: LossInputs,
    *,
    agg: str = "token-mean",
    norm_length: float | None = None,
    teacher_weight: float = 1.0,
    reward_weight: float = 0.0,
) -> LossOutputs:
    """Reverse-KL distillation as policy gradient: the teacher's logprobs come in `ref_logprobs`, and the
    loss is REINFORCE on the advantage A_t = teacher_weight * `distillation_advantages` + reward_weight *
    inputs.advantages (the estimator's reward advantage, ignored at the default reward_weight = 0). With
    teacher_weight = 1 and reward_weight = 0 its expected gradient is that of KL(student || teacher); a
    reward_weight > 0 adds the reward's policy gradient, scaled, as a second term."""
    teacher = require(inputs, "ref_logprobs", "distillation_loss")
    distill = distillation_advantages(inputs.logprobs, teacher, inputs.mask)
    adv = teacher_weight * distill
    if reward_weight:
        adv = adv + reward_weight * _advantages(inputs)
    per_token = -adv * inputs.logprobs
    metrics = _ratio_metrics(_log_ratio(inputs.logprobs, inputs.anchor_logprobs, inputs.mask), inputs.mask)
    metrics["kl/teacher_reverse"] = masked_mean(-distill, inputs.mask)
    return _finish(per_token, inputs, metrics, agg=agg, kl_coef=0.0, kl_estimator="k3",
                   entropy_coef=0.0, norm_length=norm_length)


def value_loss(
    inputs: LossInputs, *, clip: float | None = 0.2, agg: str = "token-mean", norm_length: float | None = None
) -> LossOutputs:
    """PPO clipped value loss (Schulman et al. 2017; as in OpenAI baselines):
    L_t = 1/2 max((V_t - R_t)^2, (V_old + clip(V_t - V_old, -c, c) - R_t)^2). `clip=None` disables clipping."""
    values = require(inputs, "values", "value_loss")
    # targets zeroed at masked positions (torch.where): a NaN there would reach the gradient through the square
    returns = torch.where(inputs.mask.bool(), require(inputs, "returns", "value_loss").detach(), 0.0)
    err = (values - returns).square()
    metrics: dict[str, Tensor] = {}
    if clip is not None:
        old = torch.where(inputs.mask.bool(), require(inputs, "old_values", "value_loss with clip").detach(), 0.0)
        clipped = old + (values - old).clamp(-clip, clip)
        err_clipped = (clipped - returns).square()
        metrics["value/clip_frac"] = masked_mean((err_clipped > err).detach().to(err.dtype), inputs.mask)
        err = torch.maximum(err, err_clipped)
    loss = 0.5 * aggregate(err, inputs.mask, agg, norm_length)
    var_r = _masked_var(returns, inputs.mask)
    metrics["value/loss"] = loss.detach()
    metrics["value/explained_variance"] = 1 - _masked_var(returns - values.detach(), inputs.mask) / var_r.clamp(min=1e-8)
    return LossOutputs(loss=loss, metrics=metrics)


def _masked_var(x: Tensor, mask: Tensor) -> Tensor:
    mean = masked_mean(x, mask)
    return masked_mean((x - mean).square(), mask)


distillation_loss.reads_reference = True  # type: ignore[attr-defined]  # it matches the reference, always


# ------------------------------------------------------------------ the catalogue ported from other frameworks


def sapo_loss(
    inputs: LossInputs,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    agg: str = "seq-mean-token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    norm_length: float | None = None,
) -> LossOutputs:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347, the SAPO objective):
    a smooth gate on the token ratio in place of PPO's hard clip,
    L_t = -f(r_t) A_t,  f(r) = sigmoid(tau (r - 1)) * 4 / tau,  tau = tau_pos if A_t > 0 else tau_neg.

    Its gradient is 4 s (1 - s) r A grad log pi with s = sigmoid(tau (r - 1)): exactly the policy gradient
    at r = 1, fading smoothly (never cut to 0) as r leaves 1, faster for a larger tau. tau_neg > tau_pos
    damps negative-advantage updates more, as the paper recommends (defaults 1.0 / 1.05 as Trinity-RFT's
    `sapo`; the gate as verl's); the paper and verl aggregate seq-mean-token-mean.
    """
    log_ratio = _log_ratio(inputs.logprobs, inputs.anchor_logprobs, inputs.mask)
    ratio = log_ratio.exp()
    adv = _advantages(inputs)
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -gate * (4.0 / tau) * adv
    metrics = _ratio_metrics(log_ratio, inputs.mask, ratio)
    with torch.no_grad():  # the gate's slope relative to the plain policy gradient's (1 at r = 1)
        g = gate.detach()
        metrics["sapo/grad_scale"] = masked_mean(4 * g * (1 - g) * ratio.detach(), inputs.mask)
    return _finish(per_token, inputs, metrics, agg=agg, kl_coef=kl_coef, kl_estimator=kl_estimator,
                   entropy_coef=entropy_coef, norm_length=norm_length)


def gmpo_loss(
    inputs: LossInputs,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    agg: str = "seq-mean-token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    norm_length: float | None = None,
) -> LossOutputs:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673, eq. 4): the
    geometric mean of the token-level clipped objectives of a sequence instead of their arithmetic mean,
    L_i = -A_i exp(mean_t c_t),  c_t = sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t, -clip_low, clip_high)),

    i.e. the pessimistic PPO clip taken in log space (paper: range (e^-0.4, e^0.4)). A geometric mean is
    robust to single outlier ratios, so the range can be much wider than PPO's. Implemented in token form
    (as GSPO): L_t = -A_t sg(exp(mean_t c_t)) exp(c_t - sg(c_t)), whose seq-mean-token-mean has the
    sequence form's value and gradient; a token where the clip binds has gradient 0.
    """
    mask = inputs.mask
    log_ratio = _log_ratio(inputs.logprobs, inputs.anchor_logprobs, mask)
    adv = _advantages(inputs)
    sign = torch.sign(adv)
    clipped = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-clip_low, clip_high))
    n_tok = mask.to(log_ratio.dtype).sum(-1)
    seq_log = torch.where(mask.bool(), clipped.detach(), 0.0).sum(-1) / n_tok.clamp(min=1)  # [B]
    per_token = -adv * torch.exp(seq_log[:, None] + clipped - clipped.detach())
    metrics = _ratio_metrics(log_ratio, mask)
    lr = log_ratio.detach()
    metrics["clip/high"] = _fraction((lr > clip_high) & (adv > 0), mask, metrics)
    metrics["clip/low"] = _fraction((lr < -clip_low) & (adv < 0), mask, metrics)
    has = n_tok > 0
    metrics["ratio/seq_mean"] = (seq_log.exp() * has).sum() / has.sum().clamp(min=1)
    return _finish(per_token, inputs, metrics, agg=agg, kl_coef=kl_coef, kl_estimator=kl_estimator,
                   entropy_coef=entropy_coef, norm_length=norm_length)


def _dppo_valid(logprobs: Tensor, anchor: Tensor, adv: Tensor, divergence: str, delta_low: float,
                delta_high: float) -> Tensor:
    """DPPO's binary trust region: False where the token's divergence from the anchor is past delta in
    the direction its advantage pushes (then its gradient is masked)."""
    p, p_old = logprobs.detach().exp(), anchor.detach().exp()
    if divergence == "tv":  # total variation of the two-outcome (this token / any other) distributions
        up_ok, down_ok = (p - p_old) <= delta_high, (p - p_old) >= -delta_low
    else:  # binary KL(Bernoulli(p_old) || Bernoulli(p))
        bkl = p_old * (anchor.detach() - logprobs.detach()) + (1 - p_old) * torch.log(
            (1 - p_old + 1e-8) / (1 - p + 1e-8))
        up_ok, down_ok = (bkl <= delta_high) | (p <= p_old), (bkl <= delta_low) | (p >= p_old)
    return torch.where(adv > 0, up_ok, down_ok)


def dppo_loss(
    inputs: LossInputs,
    *,
    divergence: str = "tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    ratio_cap: float = 20.0,
    agg: str = "token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    norm_length: float | None = None,
) -> LossOutputs:
    """DPPO (Divergence PPO; "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv
    2602.04879, the Binary-TV and Binary-KL variants): the trust region is a bound on the divergence
    between the anchor and the current policy at the sampled token, not on the ratio, so that a rare
    token going from 1e-5 to 1e-3 (ratio 100, negligible divergence) still learns:

        L_t = -A_t sg(min(r_t, ratio_cap)) log pi_t * valid_t,
        tv:  valid = (p - p_old <= delta_high) if A > 0 else (p - p_old >= -delta_low),
        kl:  valid = (KL_bin <= delta_high or p <= p_old) if A > 0 else (KL_bin <= delta_low or p >= p_old),
        KL_bin = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)),  p = exp(logprob).

    A token is masked only when it is past the bound in the direction its advantage pushes it, as PPO's
    clip. Ported from verl's `dppo_tv` / `dppo_kl` (whose `clip_ratio_low/high` are these deltas, and
    `clip_ratio_c` = 20 the cap). A delta left None is the authors' example recipe's (verl
    examples/dppo_trainer): 0.15 for tv, 0.05 for kl.
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"divergence must be 'tv' or 'kl', got {divergence!r}")
    default_delta = 0.15 if divergence == "tv" else 0.05
    delta_low = default_delta if delta_low is None else delta_low
    delta_high = default_delta if delta_high is None else delta_high
    log_ratio = _log_ratio(inputs.logprobs, inputs.anchor_logprobs, inputs.mask)
    r = log_ratio.detach().exp()
    adv = _advantages(inputs)
    valid = _dppo_valid(inputs.logprobs, inputs.anchor_logprobs, adv, divergence, delta_low, delta_high)
    valid = valid & inputs.mask.bool()
    per_token = torch.where(valid, -adv * r.clamp(max=ratio_cap) * inputs.logprobs, 0.0)
    mask = inputs.mask
    metrics = _ratio_metrics(log_ratio, mask, r)
    metrics["clip/high"] = _fraction(~valid & (adv > 0), mask, metrics)
    metrics["clip/low"] = _fraction(~valid & (adv < 0), mask, metrics)
    metrics["clip/ratio_cap"] = _fraction(valid & (r > ratio_cap), mask, metrics)
    return _finish(per_token, inputs, metrics, agg=agg, kl_coef=kl_coef, kl_estimator=kl_estimator,
                   entropy_coef=entropy_coef, norm_length=norm_length)


def _top_covariance(logprobs: Tensor, adv: Tensor, mask: Tensor, ratio: float) -> Tensor:
    """[B, T] bool: the max(1, int(ratio * N)) valid tokens with the largest Cov(log pi, A) terms,
    (log pi_t - mean log pi)(A_t - mean A) over the N valid tokens (none when N = 0)."""
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        return torch.zeros_like(m)
    lp = logprobs.detach()
    cov = (lp - masked_mean(lp, m)) * (adv - masked_mean(adv, m))
    cov = torch.where(m, cov, -torch.inf)
    idx = torch.topk(cov.flatten(), max(1, int(n * ratio))).indices
    return torch.zeros_like(m).flatten().index_fill_(0, idx, True).view_as(m)


def kl_cov_loss(
    inputs: LossInputs,
    *,
    kl_cov_ratio: float = 0.002,
    kl_cov_coef: float = 1.0,
    agg: str = "token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    norm_length: float | None = None,
) -> LossOutputs:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv 2505.22617, sec. 5, KL-Cov): the entropy of the policy collapses through the few tokens
    whose log-probability and advantage covary most, so only those are held back, by a KL penalty:

        L_t = -r_t A_t + kl_cov_coef * |log r_t| * [t in top kl_cov_ratio of Cov_t],
        Cov_t = (log pi_t - mean log pi)(A_t - mean A) over the valid tokens (detached).

    The surrogate is unclipped, and the penalty is |log r| (the authors' code and verl's `kl_cov`; the
    paper writes it as a KL between the anchor and the current policy). The top fraction is taken over
    the tokens this call sees: under micro-batching, per micro-batch (as verl does), so the selection,
    unlike the other losses, depends on how the step is packed. Paper: kl_cov_ratio 2e-3 (7B), 2e-4 (32B).
    """
    if not 0.0 < kl_cov_ratio <= 1.0:
        raise ValueError(f"kl_cov_ratio must be in (0, 1], got {kl_cov_ratio}")
    log_ratio = _log_ratio(inputs.logprobs, inputs.anchor_logprobs, inputs.mask)
    ratio = log_ratio.exp()
    adv = _advantages(inputs)
    top = _top_covariance(inputs.logprobs, adv, inputs.mask, kl_cov_ratio)
    per_token = -ratio * adv + torch.where(top, kl_cov_coef * log_ratio.abs(), 0.0)
    metrics = _ratio_metrics(log_ratio, inputs.mask, ratio)
    metrics["kl_cov/selected_frac"] = _fraction(top, inputs.mask, metrics)
    metrics["kl_cov/abs_log_ratio"] = masked_mean(log_ratio.detach().abs(), inputs.mask)
    return _finish(per_token, inputs, metrics, agg=agg, kl_coef=kl_coef, kl_estimator=kl_estimator,
                   entropy_coef=entropy_coef, norm_length=norm_length)
