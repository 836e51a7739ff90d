"""The catalogue ported from other frameworks (SAPO, GMPO, DPPO, KL-Cov, GPG, pass@k, token-sum, the
straight-through KL estimators, the porting conventions) against hand-worked values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algos import (
    AdvantageInputs,
    LossInputs,
    aggregate,
    dppo_loss,
    gmpo_loss,
    gpg_advantages,
    grpo_advantages,
    gspo_loss,
    kl_cov_loss,
    kl_estimate,
    passk_advantages,
    ppo_loss,
    reinforce_loss,
    remax_advantages,
    sapo_loss,
    to_tokens,
)
from tidal.core.plugins import registry

t = torch.tensor
F64 = torch.float64


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_registered_by_name():
    assert set(registry.names("policy_loss")) >= {"sapo", "gmpo", "dppo", "kl_cov"}
    assert set(registry.names("advantage_estimator")) >= {"gpg", "passk", "remax"}


# ------------------------------------------------------------------------------------------ SAPO


def test_sapo_is_the_policy_gradient_at_ratio_one(inputs, grad):
    inp = inputs([[0.0, 0.0]], [[1.0, -2.0]])
    out = sapo_loss(inp)
    # f(1) = sigmoid(0) 4 / tau = 2 / tau; seq-mean-token-mean over one row
    assert out.loss.item() == pytest.approx(-(2 / 1.0 * 1.0 + 2 / 1.05 * -2.0) / 2)
    torch.testing.assert_close(grad(out, inp), t([[-1.0, 2.0]], dtype=F64) / 2)  # 4 s (1 - s) r = 1


def test_sapo_gate_fades_the_gradient_with_its_own_temperature_per_sign(inputs, grad):
    inp = inputs([[math.log(1.5), math.log(1.5)]], [[1.0, -1.0]])
    out = sapo_loss(inp, tau_pos=1.0, tau_neg=2.0)
    s_pos, s_neg = sig(0.5), sig(1.0)
    assert out.loss.item() == pytest.approx((-4 * s_pos + 2 * s_neg) / 2)
    # d/dlogp of -f(r) A = -4 s (1 - s) r A (tau cancels)
    expected = t([[-4 * s_pos * (1 - s_pos) * 1.5, 4 * s_neg * (1 - s_neg) * 1.5]], dtype=F64) / 2
    torch.testing.assert_close(grad(out, inp), expected)


# ------------------------------------------------------------------------------------------ GMPO


def test_gmpo_is_the_geometric_mean_with_a_log_space_clip(inputs, grad):
    inp = inputs([[0.1, 0.6]], [[1.0, 1.0]])
    out = gmpo_loss(inp)  # clip at +-0.4 in log space: 0.6 -> 0.4
    assert out.loss.item() == pytest.approx(-math.exp(0.25))
    torch.testing.assert_close(grad(out, inp), t([[-math.exp(0.25) / 2, 0.0]], dtype=F64))
    assert out.metrics["clip/high"].item() == pytest.approx(0.5)


def test_gmpo_clips_pessimistically_for_negative_advantages(inputs, grad):
    inp = inputs([[-0.6, 0.1], [-0.6, 0.1]], [[-1.0, -1.0], [1.0, 1.0]])
    out = gmpo_loss(inp)
    # A < 0: -0.6 clipped to -0.4 (no gradient); A > 0: -0.6 stays (the clip only binds above)
    neg, pos = math.exp((-0.4 + 0.1) / 2), math.exp((-0.6 + 0.1) / 2)
    assert out.loss.item() == pytest.approx((neg - pos) / 2)
    torch.testing.assert_close(grad(out, inp), t([[0.0, neg / 2], [-pos / 2, -pos / 2]], dtype=F64) / 2)


# ------------------------------------------------------------------------------------------ DPPO


def dppo_inputs(p, p_old, adv):
    lp, old = t([p], dtype=F64).log(), t([p_old], dtype=F64).log()
    return LossInputs(logprobs=lp.clone().requires_grad_(), behaviour_logprobs=old, advantages=t([adv], dtype=F64),
                      mask=torch.ones_like(lp, dtype=torch.bool))


def test_dppo_tv_masks_only_past_the_bound_in_the_advantage_direction(grad):
    # p_old 0.5 -> 0.8 (TV 0.3 > 0.2): masked for A > 0, kept for A < 0; 0.5 -> 0.6 kept;
    # a rare token 1e-5 -> 1e-3 (ratio 100, TV ~1e-3) kept, its weight capped at 20
    inp = dppo_inputs([0.8, 0.8, 0.6, 1e-3], [0.5, 0.5, 0.5, 1e-5], [1.0, -1.0, 1.0, 1.0])
    out = dppo_loss(inp)
    torch.testing.assert_close(grad(out, inp), t([[0.0, 1.6, -1.2, -20.0]], dtype=F64) / 4)
    assert out.metrics["clip/high"].item() == pytest.approx(0.25)
    assert out.metrics["clip/ratio_cap"].item() == pytest.approx(0.25)


def test_dppo_binary_kl(grad):
    # KL_bin(0.5 || 0.8) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.2231
    inp = dppo_inputs([0.8], [0.5], [1.0])
    assert grad(dppo_loss(inp, divergence="kl"), inp).item() == 0.0
    inp = dppo_inputs([0.8], [0.5], [1.0])
    assert grad(dppo_loss(inp, divergence="kl", delta_high=0.25), inp).item() == pytest.approx(-1.6)
    inp = dppo_inputs([0.2], [0.5], [1.0])  # moved against the advantage: never masked
    assert grad(dppo_loss(inp, divergence="kl"), inp).item() == pytest.approx(-0.4)
    with pytest.raises(ValueError, match="divergence must be"):
        dppo_loss(inp, divergence="js")


# ------------------------------------------------------------------------------------------ KL-Cov


def test_kl_cov_penalises_the_top_covariance_tokens_only(inputs, grad):
    lr = [[0.1, -0.2, 0.3, 0.05]]
    # Cov terms (logp - (-1.625)) (A - 0.5): 0.3125, 0.5625, 1.6875, 0.6875: token 2 is the top quarter
    inp = inputs(lr, [[1.0, -1.0, 2.0, 0.0]], logp=[[-1.0, -2.0, -0.5, -3.0]])
    out = kl_cov_loss(inp, kl_cov_ratio=0.25, kl_cov_coef=1.0)
    r = [math.exp(x) for x in lr[0]]
    assert out.loss.item() == pytest.approx((-r[0] + r[1] - 2 * r[2] + 0.3) / 4)
    torch.testing.assert_close(grad(out, inp), t([[-r[0], r[1], -2 * r[2] + 1.0, 0.0]], dtype=F64) / 4)
    assert out.metrics["kl_cov/selected_frac"].item() == pytest.approx(0.25)
    # at least one token is always selected; none in an empty batch
    assert kl_cov_loss(inputs(lr, [[1.0, -1.0, 2.0, 0.0]]), kl_cov_ratio=0.002).metrics["kl_cov/selected_frac"] > 0
    empty = inputs(lr, [[1.0, -1.0, 2.0, 0.0]], mask=[[0, 0, 0, 0]])
    assert kl_cov_loss(empty).loss.item() == 0.0
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        kl_cov_loss(inp, kl_cov_ratio=0.0)


# ------------------------------------------------------------------------------------------ gradient checks


@pytest.mark.parametrize("name", ["sapo", "gmpo", "kl_cov"])  # dppo's weight is stop-gradient, as CISPO's
def test_gradcheck_float64(name):
    torch.manual_seed(0)
    old = -torch.rand(2, 5, dtype=F64) - 0.5
    adv = torch.randn(2, 1, dtype=F64).expand(2, 5).contiguous()
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    loss = registry.create("policy_loss", name, **({"kl_cov_ratio": 0.3} if name == "kl_cov" else {}))

    def f(lp):
        return loss(LossInputs(logprobs=lp, behaviour_logprobs=old, advantages=adv, mask=mask)).loss

    lp = (old + 0.3 * torch.randn(2, 5, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(f, (lp,))


# ------------------------------------------------------------------------------------------ ReMax


def test_remax_is_reward_minus_the_greedy_members_reward():
    rewards = t([1.0, 0.0, 0.5, 1.0, 0.0, 0.25], dtype=F64)
    groups = t([0, 0, 0, 1, 1, 1])
    baseline = t([False, False, True, True, False, False])  # the greedy member may sit anywhere in its group
    # group 0: baseline 0.5 -> 0.5, -0.5, (0); group 1: baseline 1.0 -> (0), -1.0, -0.75
    assert remax_advantages(rewards, groups, baseline).tolist() == [0.5, -0.5, 0.0, 0.0, -1.0, -0.75]
    out = registry.create("advantage_estimator", "remax")(
        AdvantageInputs(rewards=rewards, mask=torch.ones(6, 2, dtype=torch.bool), group_index=groups, baseline=baseline))
    assert out.advantages[:, 0].tolist() == [0.5, -0.5, 0.0, 0.0, -1.0, -0.75]
    assert registry.create("advantage_estimator", "remax").greedy_baseline


def test_remax_refuses_a_group_without_exactly_one_greedy_member():
    groups = t([0, 0, 1, 1])
    with pytest.raises(ValueError, match="group 1 has 0"):
        remax_advantages(t([1.0, 0.0, 1.0, 0.0]), groups, t([True, False, False, False]))
    with pytest.raises(ValueError, match="group 0 has 2"):
        remax_advantages(t([1.0, 0.0, 1.0, 0.0]), groups, t([True, True, False, True]))
    with pytest.raises(ValueError, match="needs AdvantageInputs.baseline"):
        registry.create("advantage_estimator", "remax")(AdvantageInputs(
            rewards=t([1.0, 0.0]), mask=torch.ones(2, 1, dtype=torch.bool), group_index=t([0, 0])))


def test_remax_learns_with_its_greedy_baseline():
    """A tabular policy over V = 8 tokens at each of 3 positions, reward = the share of positions matching a
    target; each step 8 groups of 7 samples plus the greedy (argmax) member, whose reward is the baseline;
    REINFORCE on the 56 sampled completions, one Adam step."""
    torch.manual_seed(0)
    V, T, G, n_groups = 8, 3, 8, 8
    target, pos = t([1, 5, 2]), torch.arange(T)
    logits = torch.zeros(T, V)
    logits[:, 0] = 1.0  # the greedy completion starts wrong everywhere
    logits.requires_grad_()
    opt = torch.optim.Adam([logits], lr=0.1)
    group = torch.arange(n_groups * G) // G
    is_greedy = torch.arange(n_groups * G) % G == G - 1
    start = logits.detach().softmax(-1)[pos, target].mean().item()
    for _ in range(64):
        y = torch.distributions.Categorical(logits=logits.detach()).sample((n_groups * G,))
        y[is_greedy] = logits.detach().argmax(-1)
        r = (y == target).float().mean(-1)
        mask = (~is_greedy)[:, None].expand(-1, T)  # the greedy member is not trained
        adv = to_tokens(remax_advantages(r, group, is_greedy), mask)
        lp = logits.log_softmax(-1)[pos, y]
        opt.zero_grad()
        reinforce_loss(LossInputs(logprobs=lp, behaviour_logprobs=lp.detach(), advantages=adv, mask=mask)).loss.backward()
        opt.step()
    end = logits.detach().softmax(-1)[pos, target].mean().item()
    assert start < 0.15 and end > 0.8, (start, end)
    assert (logits.detach().argmax(-1) == target).all()  # the greedy completion, the baseline, is now right


# ------------------------------------------------------------------------------------------ GPG and pass@k


def test_gpg_scales_by_the_share_of_valid_samples():
    rewards, groups = t([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), t([0, 0, 1, 1, 2, 2])
    # 2 of 6 samples in a group with different rewards: alpha = 3; r - mean = +-0.5
    assert gpg_advantages(rewards, groups).tolist() == [1.5, -1.5, 0.0, 0.0, 0.0, 0.0]
    assert gpg_advantages(t([1.0, 1.0]), t([0, 0])).tolist() == [0.0, 0.0]
    out = registry.create("advantage_estimator", "gpg")(
        AdvantageInputs(rewards=rewards, mask=torch.ones(6, 2, dtype=torch.bool), group_index=groups))
    assert out.advantages[:, 1].tolist() == [1.5, -1.5, 0.0, 0.0, 0.0, 0.0]


def test_passk_advantages_by_hand():
    groups = t([0, 0, 0, 0])
    # n = 4, c = 1, k = 2: R = 1 - C(3,2)/C(4,2) = 0.5, sigma = 0.5; A+ = 1, A- = (0.5 - C(2,1)/C(3,1)) / 0.5
    adv = passk_advantages(t([1.0, 0.0, 0.0, 0.0], dtype=F64), groups, k=2)
    torch.testing.assert_close(adv, t([1.0, -1 / 3, -1 / 3, -1 / 3], dtype=F64))
    assert adv.sum().item() == pytest.approx(0.0)
    # 3 of 4 correct: every pair passes, nothing to learn; none correct: the same
    assert passk_advantages(t([1.0, 1.0, 1.0, 0.0]), groups, k=2).tolist() == [0.0] * 4
    assert passk_advantages(t([0.0, 0.0, 0.0, 0.0]), groups, k=2).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="groups of at least 5"):
        passk_advantages(t([1.0, 0.0, 0.0, 0.0]), groups, k=5)


def test_pass_at_1_is_grpo_with_the_population_std():
    rewards, groups = t([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=F64), t([0, 0, 0, 1, 1, 1, 1])
    torch.testing.assert_close(passk_advantages(rewards, groups, k=1),
                               grpo_advantages(rewards, groups, eps=0.0, unbiased_std=False))


def test_passk_threshold_decides_what_counts_as_correct():
    rewards, groups = t([0.9, 0.4, 0.4]), t([0, 0, 0])
    assert passk_advantages(rewards, groups, k=1, threshold=0.5)[0] > 0
    assert passk_advantages(rewards, groups, k=1, threshold=0.95).tolist() == [0.0] * 3


# ------------------------------------------------------------------------------------------ token-sum, KL, conventions


def test_token_sum_is_the_unnormalised_sum():
    values = t([[1.0, 2.0, torch.nan], [3.0, 100.0, 100.0]])
    mask = t([[1, 1, 0], [1, 0, 0]]).bool()
    assert aggregate(values, mask, "token-sum").item() == 6.0
    assert aggregate(values, torch.zeros_like(mask), "token-sum").item() == 0.0


@pytest.mark.parametrize("base", ["k1", "k3", "low-var-k3"])
def test_straight_through_kl_has_the_value_of_its_base_and_the_gradient_of_k2(base):
    ref = t([[-1.0, -3.0, -20.0]], dtype=F64)
    lps = [t([[-1.5, -0.5, -1.0]], dtype=F64, requires_grad=True) for _ in range(3)]
    plus, value, k2 = (kl_estimate(lp, ref, e) for lp, e in zip(lps, (base + "+", base, "k2"), strict=True))
    torch.testing.assert_close(plus, value)
    plus.sum().backward()
    k2.sum().backward()
    torch.testing.assert_close(lps[0].grad, lps[2].grad)


def test_approx_kl_is_logged_as_k3_and_k1(inputs):
    lr = [[0.2, -0.1]]
    m = ppo_loss(inputs(lr, [[1.0, 1.0]])).metrics
    assert m["kl/approx"].item() == pytest.approx(sum(math.expm1(x) - x for x in lr[0]) / 2)
    assert m["kl/approx_k1"].item() == pytest.approx(-sum(lr[0]) / 2)


def test_gspo_clip_fraction_per_sequence_or_per_token(inputs):
    # row 0 (3 tokens) clipped high, row 1 (1 token) not: 1/2 of sequences, 3/4 of tokens
    inp = inputs([[0.1, 0.1, 0.1], [0.0, 0.0, 0.0]], [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], mask=[[1, 1, 1], [1, 0, 0]])
    seq, tok = gspo_loss(inp), gspo_loss(inp, clip_frac="token")
    assert seq.metrics["clip/high"].item() == pytest.approx(0.5)
    assert tok.metrics["clip/high"].item() == pytest.approx(0.75)
    assert seq.loss.item() == tok.loss.item()
    with pytest.raises(ValueError, match="clip_frac"):
        gspo_loss(inp, clip_frac="batch")


@pytest.mark.parametrize("name", ["sapo", "gmpo", "dppo", "kl_cov"])
def test_bf16_inputs_match_fp32(name):
    torch.manual_seed(1)
    old = -torch.rand(8, 16) - 0.5
    diff = 0.1 * (2 * torch.rand(8, 16) - 1)  # ratios in [0.9, 1.1]: no bound crossed by bf16 rounding
    adv = torch.randn(8, 1).expand(8, 16).contiguous()
    loss = registry.create("policy_loss", name)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        logp = (old + diff).to(dtype).requires_grad_()
        out = loss(LossInputs(logprobs=logp, behaviour_logprobs=old.to(dtype), advantages=adv.to(dtype),
                              mask=torch.ones(8, 16, dtype=torch.bool)))
        out.loss.backward()
        assert out.loss.dtype == dtype
        results.append((out.loss.float(), logp.grad.float()))
    torch.testing.assert_close(results[1][0], results[0][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[1][1], results[0][1], atol=2e-3, rtol=5e-2)
