"""OAPL, M2PO and TOPR against values worked out by hand from the papers' formulas, their gradients,
extreme inputs (log-ratios of +-1000, -inf behaviour logprobs where masked, empty rows, all-masked
batches) and a short learning run of each on a tabular policy trained from a lagged sampler."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algos import (
    LossInputs,
    dr_grpo_advantages,
    grpo_advantages,
    m2po_loss,
    m2po_mask,
    oapl_advantages,
    oapl_loss,
    to_tokens,
    topr_loss,
)
from tidal.algos.estimators import AdvantageInputs, OAPLEstimator

t = torch.tensor
F64 = torch.float64


# ------------------------------------------------------------------------------------------ OAPL


def test_oapl_advantage_is_reward_minus_the_soft_max_value():
    a = oapl_advantages(t([1.0, 0.0, 0.0, 1.0], dtype=F64), t([0, 0, 0, 1]), beta=1.0)
    # group 0: V* = 1 * log((e^1 + e^0 + e^0) / 3) = log(4.718282 / 3) = log(1.572761) = 0.452832
    # group 1 (one sample): V* = log(e^1 / 1) = 1, A = 0
    v = math.log((math.e + 2) / 3)
    torch.testing.assert_close(a, t([1 - v, -v, -v, 0.0], dtype=F64))
    # beta = 0.5, rewards (1, 0): V* = 0.5 log((e^2 + 1) / 2) = 0.5 log(4.194528) = 0.716891
    a = oapl_advantages(t([1.0, 0.0], dtype=F64), t([0, 0]), beta=0.5)
    v = 0.5 * math.log((math.e ** 2 + 1) / 2)
    torch.testing.assert_close(a, t([1 - v, -v], dtype=F64))


def test_oapl_advantage_limits_and_stability():
    r, g = t([3.0, 1.0, 2.0], dtype=F64), t([0, 0, 0])
    # beta -> inf: V* -> mean (2), Dr.GRPO's baseline; beta -> 0: V* -> max (3)
    torch.testing.assert_close(oapl_advantages(r, g, beta=1e6), dr_grpo_advantages(r, g), atol=1e-5, rtol=0)
    torch.testing.assert_close(oapl_advantages(r, g, beta=1e-3), r - 3.0, atol=1e-2, rtol=0)
    # r / beta = 1e5 would overflow exp(): the group max is taken out first.
    # V* = 1000 + 0.01 log((1 + e^-1e5) / 2) = 1000 - 0.01 ln 2 = 999.993069
    a = oapl_advantages(t([1000.0, 0.0]), t([0, 0]), beta=0.01)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, t([0.01 * math.log(2), -1000 + 0.01 * math.log(2)]))
    assert oapl_advantages(t([]), t([], dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError, match="beta"):
        oapl_advantages(r, g, beta=0.0)


def test_oapl_estimator_broadcasts_to_tokens():
    mask = t([[1, 1, 0], [1, 0, 0]]).bool()
    out = OAPLEstimator(beta=1.0)(AdvantageInputs(rewards=t([1.0, 0.0]), mask=mask, group_index=t([0, 0])))
    v = math.log((math.e + 1) / 2)  # V* of rewards (1, 0) at beta 1
    torch.testing.assert_close(out.advantages, t([[1 - v, 1 - v, 0.0], [-v, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="beta"):
        OAPLEstimator(beta=-1.0)


def test_oapl_loss_value_gradient_and_metrics_by_hand(inputs, grad):
    inp = inputs([[0.2, -0.4], [1.0, 7.0]], [[0.3, 0.3], [-0.1, 0.0]], mask=[[1, 1], [1, 0]])
    out = oapl_loss(inp, beta=0.5)
    # seq 0: s = 0.2 - 0.4 = -0.2, A = 0.3, residual = 0.5 * -0.2 - 0.3 = -0.4, squared 0.16
    # seq 1: s = 1.0 (the masked 7.0 is not summed), A = -0.1, residual = 0.5 - (-0.1) = 0.6, squared 0.36
    assert out.loss.item() == pytest.approx((0.16 + 0.36) / 2)
    # d/dlogp_t = 2 residual_i beta / N: seq 0: 2 * -0.4 * 0.5 / 2 = -0.2; seq 1: 2 * 0.6 * 0.5 / 2 = 0.3
    torch.testing.assert_close(grad(out, inp), t([[-0.2, -0.2], [0.3, 0.0]], dtype=F64))
    assert out.metrics["oapl/seq_log_ratio_mean"].item() == pytest.approx((-0.2 + 1.0) / 2)
    assert out.metrics["oapl/residual_mean"].item() == pytest.approx((-0.4 + 0.6) / 2)


def test_oapl_anchor_is_old_logprobs_when_given_and_is_weights_are_refused(inputs):
    inp = inputs([[0.5]], [[0.0]], old_logprobs=t([[-0.5]], dtype=F64))  # logp = -0.5: log-ratio 0 vs old
    assert oapl_loss(inp, beta=1.0).loss.item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="no is_weights"):
        oapl_loss(inputs([[0.1]], [[1.0]], is_weights=t([[1.0]], dtype=F64)))


def test_oapl_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=g, dtype=F64) - 0.5
    adv = torch.randn(3, 1, generator=g, dtype=F64).expand(3, 4)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]).bool()
    ent = torch.rand(3, 4, generator=g, dtype=F64)

    def f(logp, entropy):
        return oapl_loss(LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=adv, mask=mask,
                                    ref_logprobs=old - 0.3, entropy=entropy),
                         beta=0.7, kl_coef=0.2, entropy_coef=0.1).loss

    logp = (old + 0.3 * torch.randn(3, 4, generator=g, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(f, (logp, ent.requires_grad_()))


# ------------------------------------------------------------------------------------------ M2PO


def test_m2po_masks_the_largest_second_moments_until_tau_by_hand(inputs, grad):
    inp = inputs([[0.1, 0.2, 0.3, -0.1]], [[1.0, 1.0, 1.0, 1.0]])
    out = m2po_loss(inp, tau=0.04)
    # trust-region tokens (A > 0, r > 1): the first three, (log r)^2 = 0.01, 0.04, 0.09: mean 0.14 / 3 =
    # 0.0467 > 0.04, so the largest (0.09, token 2) goes; 0.05 / 2 = 0.025 <= 0.04 stops
    assert out.metrics["m2po/m2_before"].item() == pytest.approx(0.14 / 3)
    assert out.metrics["m2po/m2_after"].item() == pytest.approx(0.025)
    assert out.metrics["m2po/masked_frac"].item() == pytest.approx(1 / 4)
    # L = -(1/4) sum_kept r_t A_t = -(e^0.1 + e^0.2 + e^-0.1) / 4 = -(1.105171 + 1.221403 + 0.904837) / 4
    r = [math.exp(0.1), math.exp(0.2), math.exp(0.3), math.exp(-0.1)]
    assert out.loss.item() == pytest.approx(-(r[0] + r[1] + r[3]) / 4)
    # d/dlogp_t of -r_t A_t / 4 is -r_t A_t / 4; the masked token has none
    torch.testing.assert_close(grad(out, inp), t([[-r[0] / 4, -r[1] / 4, 0.0, -r[3] / 4]], dtype=F64))


def test_m2po_over_all_tokens_and_tau_zero(inputs):
    # all four tokens as candidates: (0.01 + 0.04 + 0.09 + 0.01) / 4 = 0.0375 <= 0.04: nothing masked
    out = m2po_loss(inputs([[0.1, 0.2, 0.3, -0.1]], [[1.0] * 4]), tau=0.04, trust_region_only=False)
    assert out.metrics["m2po/masked_frac"].item() == 0.0
    # tau = 0 drops every candidate with log r != 0; A < 0 with r > 1 is no trust-region token, it stays
    out = m2po_loss(inputs([[0.1, 0.0, 0.3]], [[1.0, 1.0, -1.0]]), tau=0.0)
    assert out.metrics["m2po/masked_frac"].item() == pytest.approx(1 / 3)


def test_m2po_mask_is_algorithm_1():
    """The sort-and-prefix mask drops exactly what the paper's greedy loop drops."""
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        m2 = torch.rand(40, generator=g, dtype=F64) ** 3 * 0.3
        cand = torch.rand(40, generator=g) < 0.7
        tau = float(torch.rand((), generator=g)) * 0.08
        left, dropped = set(cand.nonzero().flatten().tolist()), set()
        while left and sum(m2[i].item() for i in left) / len(left) > tau:
            j = max(left, key=lambda i: m2[i].item())
            left.remove(j)
            dropped.add(j)
        assert set(m2po_mask(m2, cand, tau).nonzero().flatten().tolist()) == dropped


def test_m2po_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(2, 5, generator=g, dtype=F64) - 0.5
    adv = t([[1.0], [-0.5]], dtype=F64).expand(2, 5)
    mask = t([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]).bool()

    def f(logp):
        return m2po_loss(LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=adv, mask=mask),
                         tau=0.02).loss

    logp = (old + 0.4 * torch.randn(2, 5, generator=g, dtype=F64)).requires_grad_()
    assert m2po_loss(LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=adv, mask=mask),
                     tau=0.02).metrics["m2po/masked_frac"] > 0  # the mask acts here
    assert torch.autograd.gradcheck(f, (logp,))


# ------------------------------------------------------------------------------------------ TOPR


def test_topr_sequence_level_by_hand(inputs, grad):
    inp = inputs([[0.5, 0.5], [-0.3, -0.4], [0.3, 0.4]], [[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]])
    out = topr_loss(inp)
    # logp = -1 + log-ratio. seq 0 positive: weight 1, per token -1 * -0.5 = 0.5, mean 0.5
    # seq 1 negative, log rho = -0.7: weight e^-0.7 = 0.496585, per token w * logp = w * (-1.3, -1.4)
    # seq 2 negative, log rho = 0.7 > 0: weight min(e^0.7, 1) = 1, per token logp = (-0.7, -0.6)
    w = math.exp(-0.7)
    seq = [0.5, w * (-1.3 - 1.4) / 2, (-0.7 - 0.6) / 2]
    assert out.loss.item() == pytest.approx(sum(seq) / 3)
    # d/dlogp_t = -w A / (len * n_seq) = -w A / 6 (the weight is a stop-gradient)
    torch.testing.assert_close(grad(out, inp), t([[-1 / 6] * 2, [w / 6] * 2, [1 / 6] * 2], dtype=F64))
    assert out.metrics["topr/truncated_frac"].item() == pytest.approx(2 / 6)


def test_topr_token_level_by_hand(inputs, grad):
    inp = inputs([[-0.3, 0.4, 0.2]], [[-1.0, -1.0, 2.0]])
    out = topr_loss(inp, level="token", agg="token-mean")
    # token 0: A < 0, r = e^-0.3 -> weight 0.740818; token 1: A < 0, r > 1 -> 1; token 2: A > 0 -> 1
    w0 = math.exp(-0.3)
    torch.testing.assert_close(grad(out, inp), t([[w0 / 3, 1 / 3, -2 / 3]], dtype=F64))
    # L = mean(-w A logp) = (w0 * -1.3 + 1 * -0.6 - 2 * -0.8) / 3
    assert out.loss.item() == pytest.approx((w0 * -1.3 - 0.6 + 1.6) / 3)
    with pytest.raises(ValueError, match="level"):
        topr_loss(inp, level="batch")


# ------------------------------------------------------------------------------------------ all three

LOSSES = {"oapl": oapl_loss, "m2po": m2po_loss, "topr": topr_loss}


@pytest.mark.parametrize("name", LOSSES)
def test_extreme_inputs_give_finite_loss_and_gradient(name):
    old = t([[-1.0, -1.0, -float("inf"), -1.0], [-2.0, -float("inf"), -float("inf"), -float("inf")],
             [-1.0, -1.0, -1.0, -1.0], [-float("inf")] * 4], dtype=F64)
    logp = t([[999.0, -1001.0, -0.5, 999.0], [-1002.0, -0.3, -0.2, -0.1], [-1.0] * 4, [-0.5] * 4],
             dtype=F64).requires_grad_()
    mask = t([[1, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]).bool()  # row 2, 3: no token
    adv = t([[1.0], [-1.0], [0.5], [0.0]], dtype=F64).expand(4, 4) * mask
    out = LOSSES[name](LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=adv, mask=mask))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    assert (logp.grad[~mask] == 0).all()


@pytest.mark.parametrize("name", LOSSES)
def test_all_masked_batch_gives_zero_loss_and_gradient(name):
    logp = t([[-0.5, -0.2], [-1.0, -3.0]], dtype=F64).requires_grad_()
    out = LOSSES[name](LossInputs(logprobs=logp, behaviour_logprobs=t([[-float("inf")] * 2] * 2, dtype=F64),
                                  advantages=torch.zeros(2, 2, dtype=F64), mask=torch.zeros(2, 2, dtype=torch.bool)))
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert (logp.grad == 0).all()


# ------------------------------------------------------------------------------------------ learning


def _learn(loss, advantages, *, steps=64, lag=8, lr=0.1, seed=0):
    """A tabular policy over V = 8 tokens at each of 3 positions, reward = the fraction of positions
    matching a target; each step 8 groups of 8 samples are drawn from a copy of the policy refreshed
    every `lag` steps (the lagged sampler), then one Adam step. Returns the expected reward before and
    after (the mean over positions of the target token's probability)."""
    torch.manual_seed(seed)
    V, T, N = 8, 3, 64
    target = t([1, 5, 2])
    pos = torch.arange(T)
    logits = torch.zeros(T, V, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=lr)
    group = torch.arange(N) // 8
    mask = torch.ones(N, T, dtype=torch.bool)

    def reward() -> float:
        return logits.detach().softmax(-1)[pos, target].mean().item()

    start = reward()
    lagged = logits.detach().clone()
    for step in range(steps):
        if step % lag == 0:
            lagged = logits.detach().clone()
        y = torch.distributions.Categorical(logits=lagged).sample((N,))  # [N, T]
        r = (y == target).float().mean(-1)
        inp = LossInputs(logprobs=logits.log_softmax(-1)[pos, y], behaviour_logprobs=lagged.log_softmax(-1)[pos, y],
                         advantages=to_tokens(advantages(r, group), mask), mask=mask)
        opt.zero_grad()
        loss(inp).loss.backward()
        opt.step()
    return start, reward()


@pytest.mark.parametrize(("name", "loss", "advantages"), [
    ("oapl", lambda i: oapl_loss(i, beta=0.1), lambda r, g: oapl_advantages(r, g, beta=0.1)),
    ("m2po", m2po_loss, grpo_advantages),
    ("topr", topr_loss, dr_grpo_advantages),
])
def test_learns_from_a_lagged_sampler(name, loss, advantages):
    start, end = _learn(loss, advantages)
    assert start < 0.2 and end > 0.8, (name, start, end)
