"""Policy losses against hand-computed values, with autograd checks of where the gradient must vanish."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algos import (
    LossInputs,
    aggregate,
    cispo_loss,
    distillation_loss,
    gspo_loss,
    ppo_loss,
    reinforce_loss,
    value_loss,
)

t = torch.tensor


# ------------------------------------------------------------------------------------------ PPO


def test_ppo_ratio_one_is_the_policy_gradient(inputs, grad):
    inp = inputs([[0.0, 0.0, 0.0]], [[1.0, -2.0, 0.5]])
    out = ppo_loss(inp)
    assert out.loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    # d/dlogp of -mean(r A) at r = 1 is -A / N: the plain policy gradient
    torch.testing.assert_close(grad(out, inp), t([[-1.0, 2.0, -0.5]], dtype=torch.float64) / 3)
    assert out.metrics["clip/high"].item() == 0 and out.metrics["clip/low"].item() == 0


def test_ppo_clipped_tokens_have_zero_gradient(inputs, grad):
    # tokens: (A>0, r=1.5) clipped at 1.2; (A<0, r=0.5) clipped at 0.8;
    #         (A>0, r=0.5) unclipped; (A<0, r=1.5) unclipped
    lr = [[math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5)]]
    inp = inputs(lr, [[1.0, -1.0, 1.0, -1.0]])
    out = ppo_loss(inp, clip_low=0.2, clip_high=0.2)
    # per token: -1.2, 0.8, -0.5, 1.5
    assert out.loss.item() == pytest.approx((-1.2 + 0.8 - 0.5 + 1.5) / 4)
    g = grad(out, inp)
    torch.testing.assert_close(g, t([[0.0, 0.0, -0.5 / 4, 1.5 / 4]], dtype=torch.float64))
    assert out.metrics["clip/high"].item() == pytest.approx(0.25)
    assert out.metrics["clip/low"].item() == pytest.approx(0.25)


def test_ppo_clip_higher_is_asymmetric(inputs):
    lr = [[math.log(1.25), math.log(0.75)]]
    out = ppo_loss(inputs(lr, [[1.0, -1.0]]), clip_low=0.2, clip_high=0.28)
    # r=1.25 < 1.28: not clipped; r=0.75 < 0.8 with A<0: clipped at 0.8
    assert out.loss.item() == pytest.approx((-1.25 + 0.8) / 2)


def test_ppo_dual_clip_bounds_negative_advantage_loss(inputs, grad):
    inp = inputs([[math.log(5.0), math.log(2.0)]], [[-1.0, -1.0]])
    out = ppo_loss(inp, dual_clip=3.0)
    # r=5: min(5, 3) = 3, gradient 0; r=2: loss 2, gradient -A r / N = 2/2
    assert out.loss.item() == pytest.approx((3.0 + 2.0) / 2)
    torch.testing.assert_close(grad(out, inp), t([[0.0, 1.0]], dtype=torch.float64))
    assert out.metrics["clip/dual"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_loss(inp, dual_clip=0.5)


def test_ppo_uses_old_logprobs_as_anchor_and_applies_is_weights():
    behaviour = t([[-1.0, -1.0]], dtype=torch.float64)
    proximal = t([[-0.5, -1.0]], dtype=torch.float64)
    logp = proximal.clone().requires_grad_()
    inp = LossInputs(logprobs=logp, behaviour_logprobs=behaviour, old_logprobs=proximal,
                     advantages=t([[1.0, 1.0]], dtype=torch.float64), mask=torch.ones(1, 2, dtype=torch.bool),
                     is_weights=t([[0.5, 2.0]], dtype=torch.float64))
    out = ppo_loss(inp)
    # ratio vs proximal is 1; weighted: -(0.5 + 2)/2
    assert out.loss.item() == pytest.approx(-1.25)


def test_kl_and_entropy_terms(inputs):
    inp = inputs([[0.0, 0.0]], [[0.0, 0.0]], ref_logprobs=t([[-1.0 - math.log(2), -1.0]], dtype=torch.float64),
                 entropy=t([[1.0, 3.0]], dtype=torch.float64))
    out = ppo_loss(inp, kl_coef=0.5, kl_estimator="k3", entropy_coef=0.1)
    k3 = (0.5 - 1) + math.log(2)  # log r = -log 2
    assert out.metrics["kl/ref"].item() == pytest.approx(k3 / 2)
    assert out.loss.item() == pytest.approx(0.5 * k3 / 2 - 0.1 * 2.0)
    with pytest.raises(ValueError, match="needs LossInputs.ref_logprobs"):
        ppo_loss(inputs([[0.0]], [[1.0]]), kl_coef=0.1)


# ------------------------------------------------------------------------------------------ GSPO


def gspo_reference(logp, old, adv, mask, lo, hi):
    """The paper's sequence-level objective written plainly, per sequence."""
    losses = []
    for b in range(logp.shape[0]):
        m = mask[b]
        if m.sum() == 0:
            continue
        s = torch.exp((logp[b][m] - old[b][m]).mean())
        a = adv[b][m][0]
        losses.append(-torch.minimum(s * a, s.clamp(1 - lo, 1 + hi) * a))
    return torch.stack(losses).mean()


def test_gspo_matches_the_sequence_level_formula_value_and_gradient():
    torch.manual_seed(0)
    old = -torch.rand(4, 6, dtype=torch.float64)
    logp = (old + 0.05 * torch.randn(4, 6, dtype=torch.float64)).requires_grad_()
    mask = t([[1] * 6, [1] * 3 + [0] * 3, [1] + [0] * 5, [1] * 5 + [0]]).bool()
    adv = t([1.0, -1.0, 0.5, -0.2], dtype=torch.float64)[:, None].expand(4, 6) * mask
    out = gspo_loss(LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=adv, mask=mask),
                    clip_low=0.01, clip_high=0.01)
    (g,) = torch.autograd.grad(out.loss, logp)
    ref_logp = logp.detach().clone().requires_grad_()
    ref = gspo_reference(ref_logp, old, adv, mask, 0.01, 0.01)
    (g_ref,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(out.loss.detach(), ref.detach())
    torch.testing.assert_close(g, g_ref)


def test_gspo_clipped_sequence_has_zero_gradient(inputs, grad):
    inp = inputs([[0.1, 0.3]], [[1.0, 1.0]])  # s = exp(0.2) > 1 + 4e-4 with A > 0
    out = gspo_loss(inp)
    assert out.loss.item() == pytest.approx(-(1 + 4e-4))
    assert torch.count_nonzero(grad(out, inp)) == 0
    assert out.metrics["clip/high"].item() == 1.0


# ------------------------------------------------------------------------------------------ CISPO, REINFORCE, distillation


def test_cispo_keeps_gradient_with_clipped_weight(inputs, grad):
    old = [[-1.0, -2.0]]
    inp = inputs([[math.log(2.0), math.log(0.5)]], [[1.0, -1.0]], old=old)
    out = cispo_loss(inp, clip_high=0.28)
    logp = [-1.0 + math.log(2.0), -2.0 + math.log(0.5)]
    # weights: clip(2.0) = 1.28, 0.5 (no lower bound); loss = -mean(w A logp)
    expected = -(1.28 * 1.0 * logp[0] + 0.5 * -1.0 * logp[1]) / 2
    assert out.loss.item() == pytest.approx(expected)
    torch.testing.assert_close(grad(out, inp), t([[-1.28 / 2, 0.5 / 2]], dtype=torch.float64))
    assert out.metrics["clip/high"].item() == 0.5


def test_cispo_lower_bound_when_set(inputs, grad):
    inp = inputs([[math.log(0.5)]], [[1.0]])
    out = cispo_loss(inp, clip_low=0.2)
    torch.testing.assert_close(grad(out, inp), t([[-0.8]], dtype=torch.float64))


def test_reinforce_is_minus_advantage_times_logprob(inputs, grad):
    inp = inputs([[0.0, 0.0]], [[2.0, -1.0]], old=[[-0.5, -1.5]])
    out = reinforce_loss(inp)
    assert out.loss.item() == pytest.approx(-(2.0 * -0.5 + -1.0 * -1.5) / 2)
    torch.testing.assert_close(grad(out, inp), t([[-1.0, 0.5]], dtype=torch.float64))


def test_distillation_advantage_is_teacher_minus_student(inputs, grad):
    inp = inputs([[0.0, 0.0]], [[0.0, 0.0]], old=[[-1.0, -2.0]], ref_logprobs=t([[-0.5, -3.0]], dtype=torch.float64))
    out = distillation_loss(inp)
    # A = teacher - student = [0.5, -1.0]; loss = -mean(A logp)
    assert out.loss.item() == pytest.approx(-(0.5 * -1.0 + -1.0 * -2.0) / 2)
    torch.testing.assert_close(grad(out, inp), t([[-0.25, 0.5]], dtype=torch.float64))
    assert out.metrics["kl/teacher_reverse"].item() == pytest.approx((-0.5 + 1.0) / 2)


def test_distillation_weights_scale_the_teacher_term_and_add_the_reward_gradient(inputs, grad):
    """reward_weight = 0 ignores the reward advantages; reward_weight = w adds exactly w times
    REINFORCE's gradient of them; teacher_weight scales the distillation term alone."""
    teacher = t([[-0.5, -3.0, -1.0]], dtype=torch.float64)
    adv = [[2.0, -1.0, 0.5]]

    def g(fn, advantages, **kw):
        inp = inputs([[0.0, 0.0, 0.0]], advantages, old=[[-1.0, -2.0, -0.2]], ref_logprobs=teacher)
        out = fn(inp, **kw)
        return grad(out, inp), out

    g_distill, plain = g(distillation_loss, adv)
    g_zero_adv, _ = g(distillation_loss, [[0.0, 0.0, 0.0]])
    torch.testing.assert_close(g_distill, g_zero_adv)  # the default ignores the reward advantages
    g_reinforce, _ = g(reinforce_loss, adv)
    g_mixed, mixed = g(distillation_loss, adv, reward_weight=0.5)
    torch.testing.assert_close(g_mixed, g_distill + 0.5 * g_reinforce)
    g_double, _ = g(distillation_loss, adv, teacher_weight=2.0)
    torch.testing.assert_close(g_double, 2.0 * g_distill)
    g_reward_only, _ = g(distillation_loss, adv, teacher_weight=0.0, reward_weight=1.0)
    torch.testing.assert_close(g_reward_only, g_reinforce)
    # the metric stays the reverse-KL estimate, whatever the weights
    assert mixed.metrics["kl/teacher_reverse"].item() == pytest.approx(plain.metrics["kl/teacher_reverse"].item())


def test_value_loss_clipped():
    v = t([[1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    inp = LossInputs(logprobs=torch.zeros(1, 2, dtype=torch.float64), behaviour_logprobs=torch.zeros(1, 2, dtype=torch.float64),
                     advantages=torch.zeros(1, 2, dtype=torch.float64), mask=torch.ones(1, 2, dtype=torch.bool),
                     values=v, old_values=t([[0.5, 2.0]], dtype=torch.float64), returns=t([[2.0, 2.5]], dtype=torch.float64))
    out = value_loss(inp, clip=0.2)
    # token 0: max((1-2)^2, (0.7-2)^2) = 1.69; token 1: max(0.25, 0.25) = 0.25
    assert out.loss.item() == pytest.approx(0.5 * (1.69 + 0.25) / 2)
    out.loss.backward()
    # token 0 uses the clipped branch (no gradient); token 1: d/dv 0.5*(v-R)^2/2 = (2-2.5)/2
    torch.testing.assert_close(v.grad, t([[0.0, -0.25]], dtype=torch.float64))


# ------------------------------------------------------------------------------------------ aggregation and edge cases


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("token-mean", 2.0), ("seq-mean-token-mean", 2.25), ("seq-mean-token-sum", 3.0), ("seq-mean-token-sum-norm", 1.0)],
)
def test_aggregation_modes(mode, expected):
    values = t([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0], [7.0, 7.0, 7.0]])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]]).bool()  # third sequence fully masked
    n_rows = 2 if mode == "seq-mean-token-sum-norm" else 3
    assert aggregate(values[:n_rows], mask[:n_rows], mode).item() == pytest.approx(expected)


def test_unknown_aggregation_mode():
    with pytest.raises(ValueError, match="choose one of token-mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean")


LOSSES = {
    "ppo": lambda i: ppo_loss(i, dual_clip=3.0),
    "gspo": lambda i: gspo_loss(i, clip_low=0.1, clip_high=0.1),
    "cispo": cispo_loss,
    "reinforce": reinforce_loss,
    "distillation": distillation_loss,
}


@pytest.mark.parametrize("name", LOSSES)
def test_fully_masked_batch_gives_zero_loss_and_gradient(name, inputs, grad):
    inp = inputs([[0.3, -0.2]], [[1.0, 1.0]], mask=[[0, 0]], ref_logprobs=-torch.ones(1, 2, dtype=torch.float64))
    out = LOSSES[name](inp)
    assert out.loss.item() == 0.0 and all(torch.isfinite(v).all() for v in out.metrics.values())
    assert torch.count_nonzero(grad(out, inp)) == 0


@pytest.mark.parametrize("name", LOSSES)
def test_masked_sequence_gets_no_gradient(name, inputs, grad):
    inp = inputs([[0.01, 0.02], [0.3, -0.2]], [[1.0, 1.0], [-1.0, -1.0]], mask=[[1, 1], [0, 0]],
                 ref_logprobs=-torch.ones(2, 2, dtype=torch.float64))
    g = grad(LOSSES[name](inp), inp)
    assert torch.count_nonzero(g[1]) == 0 and torch.count_nonzero(g[0]) > 0


@pytest.mark.parametrize("name", LOSSES)
def test_length_one_sequences(name, inputs, grad):
    inp = inputs([[0.1], [-0.1]], [[1.0], [-1.0]], ref_logprobs=-torch.ones(2, 1, dtype=torch.float64))
    out = LOSSES[name](inp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad(out, inp)).all()


@pytest.mark.parametrize("name", LOSSES)
def test_bf16_inputs_match_fp32(name):
    torch.manual_seed(1)
    old = -torch.rand(8, 16)
    # ratios within [0.9, 1.1]: away from every clip boundary, where bf16 rounding could flip a token
    diff = 0.1 * (2 * torch.rand(8, 16) - 1)
    adv = torch.randn(8, 1).expand(8, 16).contiguous()
    ref = old - 0.2
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        logp = (old + diff).to(dtype).requires_grad_()
        inp = LossInputs(logprobs=logp, behaviour_logprobs=old.to(dtype), advantages=adv.to(dtype),
                         mask=torch.ones(8, 16, dtype=torch.bool), ref_logprobs=ref.to(dtype))
        out = LOSSES[name](inp)
        out.loss.backward()
        assert out.loss.dtype == dtype
        results.append((out.loss.float(), logp.grad.float()))
    torch.testing.assert_close(results[1][0], results[0][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[1][1], results[0][1], atol=2e-3, rtol=5e-2)


# CISPO and distillation multiply log pi by stop-gradient factors (the clipped IS weight; teacher minus
# student): by design their gradient is not the derivative of their value, so gradcheck applies to the
# surrogate they optimise. test_stop_gradient_losses_equal_their_frozen_surrogates checks that surrogate.
@pytest.mark.parametrize("name", ["ppo", "gspo", "reinforce"])
def test_gradcheck_float64(name):
    torch.manual_seed(2)
    old = -torch.rand(3, 5, dtype=torch.float64)
    # ratios spread over [0.6, 1.6] so that clipped and unclipped tokens both occur, away from kinks
    diff = torch.linspace(-0.5, 0.45, 15, dtype=torch.float64).reshape(3, 5)
    adv = t([[1.0], [-0.7], [0.4]], dtype=torch.float64).expand(3, 5).contiguous()
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).bool()
    ref = old - 0.3
    ent = torch.rand(3, 5, dtype=torch.float64)

    def f(logp):
        i = LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, entropy=ent)
        return LOSSES[name](i).loss

    assert torch.autograd.gradcheck(f, ((old + diff).requires_grad_(),))


def test_gradcheck_ppo_with_kl_and_value_loss():
    torch.manual_seed(3)
    old = -torch.rand(2, 4, dtype=torch.float64)
    ref = old + 0.2
    mask = torch.ones(2, 4, dtype=torch.bool)
    adv = torch.randn(2, 4, dtype=torch.float64)

    def f(logp):
        i = LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref)
        return ppo_loss(i, kl_coef=0.3, kl_estimator="k3").loss

    assert torch.autograd.gradcheck(f, ((old + 0.01 * torch.randn(2, 4, dtype=torch.float64)).requires_grad_(),))
    old_v = torch.randn(2, 4, dtype=torch.float64)
    returns = old_v + torch.randn(2, 4, dtype=torch.float64)

    def fv(v):
        i = LossInputs(logprobs=old, behaviour_logprobs=old, advantages=adv, mask=mask,
                       values=v, old_values=old_v, returns=returns)
        return value_loss(i, clip=10.0).loss

    assert torch.autograd.gradcheck(fv, ((old_v + 0.05).requires_grad_(),))


def test_input_shapes_are_checked_with_names():
    with pytest.raises(ValueError, match=r"LossInputs.advantages has shape \(2, 3\) but logprobs has \(2, 4\)"):
        LossInputs(logprobs=torch.zeros(2, 4), behaviour_logprobs=torch.zeros(2, 4), advantages=torch.zeros(2, 3),
                   mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"must be a \[batch, tokens\] tensor"):
        LossInputs(logprobs=torch.zeros(4), behaviour_logprobs=torch.zeros(4), advantages=torch.zeros(4),
                   mask=torch.ones(4))
    with pytest.raises(ValueError, match="must be floating point"):
        LossInputs(logprobs=torch.zeros(1, 1), behaviour_logprobs=torch.zeros(1, 1, dtype=torch.long),
                   advantages=torch.zeros(1, 1), mask=torch.ones(1, 1))


def test_stop_gradient_losses_equal_their_frozen_surrogates():
    """CISPO's gradient is REINFORCE's with the clipped ratio frozen as an IS weight; distillation's is
    REINFORCE's with the frozen advantage teacher - student. Both surrogates pass gradcheck above."""
    torch.manual_seed(4)
    old = -torch.rand(3, 5, dtype=torch.float64)
    logp0 = old + torch.linspace(-0.5, 0.45, 15, dtype=torch.float64).reshape(3, 5)
    adv = torch.randn(3, 5, dtype=torch.float64)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).bool()
    teacher = old - 0.3

    def grads(fn, **kw):
        logp = logp0.clone().requires_grad_()
        fn(LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=adv, mask=mask, **kw)).loss.backward()
        return logp.grad

    w = (logp0 - old).exp().clamp(0.0, 1.28)
    torch.testing.assert_close(grads(cispo_loss), grads(reinforce_loss, is_weights=w))

    def frozen(x):
        i = LossInputs(logprobs=x, behaviour_logprobs=old, advantages=adv, mask=mask, is_weights=w)
        return reinforce_loss(i).loss

    assert torch.autograd.gradcheck(frozen, (logp0.clone().requires_grad_(),))

    a = (teacher - logp0) * mask
    g_distill = grads(distillation_loss, ref_logprobs=teacher)
    logp = logp0.clone().requires_grad_()
    reinforce_loss(LossInputs(logprobs=logp, behaviour_logprobs=old, advantages=a, mask=mask)).loss.backward()
    torch.testing.assert_close(g_distill, logp.grad)
