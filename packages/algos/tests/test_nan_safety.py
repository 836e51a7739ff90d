"""NaN safety (issue 33): every registered policy loss gives a finite loss and gradient on extreme inputs:
log-ratios of +-1000, -inf behaviour and reference logprobs and NaN importance weights at masked
positions, an empty row; and a batch without any valid token gives loss 0 and gradient 0."""

from __future__ import annotations

import pytest
import torch

from tidal.algos import LossInputs, aggregate, kl_estimate, masked_mean, masked_whiten
from tidal.algos.aggregation import AGG_MODES
from tidal.algos.kl import KL_ESTIMATORS
from tidal.core.errors import ConfigError
from tidal.core.plugins import registry

LOSSES = registry.names("policy_loss")
INF = torch.inf
NAN = torch.nan
MASK = [[True, True, True, True], [True, True, False, False], [False, False, False, False]]


def extreme(all_masked: bool = False, weighted: bool = True) -> tuple[LossInputs, list[torch.Tensor]]:
    """Row 0: log-ratios +1000, -1000 and a reference 1000 nats either side; row 1: -inf behaviour and
    reference logprobs, NaN advantages, weights and value targets past its 2 tokens; row 2: nothing valid.
    `weighted=False`: no IS weights (for a loss that refuses a correction, OAPL)."""
    mask = torch.tensor(MASK) & (not all_masked)
    logp = torch.full((3, 4), -1.0, dtype=torch.float64)
    behaviour = logp + torch.tensor([[-1000.0, 1000.0, 0.5, -0.5], [0.1, -0.2, -INF, -INF], [-INF] * 4])
    ref = logp + torch.tensor([[1000.0, -1000.0, 0.2, 0.0], [0.3, 0.0, -INF, -INF], [-INF] * 4])
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5], [-1.0, 2.0, NAN, NAN], [NAN] * 4], dtype=torch.float64)
    weights = torch.tensor([[1.0, 2.0, 0.5, 1.0], [1.0, 1.0, NAN, INF], [NAN] * 4], dtype=torch.float64)
    leaves = [logp.requires_grad_(), torch.rand(3, 4, dtype=torch.float64).requires_grad_(),
              torch.randn(3, 4, dtype=torch.float64).requires_grad_()]
    inp = LossInputs(logprobs=leaves[0], behaviour_logprobs=behaviour, advantages=adv, mask=mask,
                     ref_logprobs=ref, is_weights=weights if weighted else None, entropy=leaves[1], values=leaves[2],
                     old_values=torch.tensor([[0.0] * 4, [0.0, 0.0, NAN, INF], [NAN] * 4], dtype=torch.float64),
                     returns=torch.tensor([[1.0] * 4, [1.0, 1.0, NAN, -INF], [NAN] * 4], dtype=torch.float64))
    return inp, leaves


def variants(name: str) -> list[dict]:
    """The defaults, and a KL term with each estimator where the loss takes one."""
    out: list[dict] = [{}]
    for est in KL_ESTIMATORS:
        try:
            registry.build("policy_loss", name, {"kl_coef": 0.1, "kl_estimator": est, "entropy_coef": 0.01})
        except (ConfigError, TypeError):
            break
        out.append({"kl_coef": 0.1, "kl_estimator": est, "entropy_coef": 0.01})
    return out


CASES = [(n, o) for n in LOSSES for o in variants(n)]


@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}-{o.get('kl_estimator', '')}" for n, o in CASES])
def test_extreme_inputs_give_a_finite_loss_and_gradient(name, options):
    loss = registry.build("policy_loss", name, options)
    inp, leaves = extreme(weighted=not getattr(loss, "refuses_correction", False))
    out = loss(inp)
    assert torch.isfinite(out.loss), (name, out.loss)
    for g in torch.autograd.grad(out.loss, leaves, allow_unused=True):
        assert g is None or torch.isfinite(g).all(), (name, g)
        assert g is None or (g[~inp.mask] == 0).all(), (name, g)  # masked positions get no gradient
    for key, v in out.metrics.items():
        assert torch.isfinite(v), (name, key, v)


@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}-{o.get('kl_estimator', '')}" for n, o in CASES])
def test_a_batch_without_valid_tokens_gives_zero(name, options):
    loss = registry.build("policy_loss", name, options)
    inp, leaves = extreme(all_masked=True, weighted=not getattr(loss, "refuses_correction", False))
    out = loss(inp)
    assert out.loss.item() == 0.0, name
    for g in torch.autograd.grad(out.loss, leaves, allow_unused=True):
        assert g is None or (g == 0).all(), (name, g)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_ignores_nan_and_inf_at_masked_positions(mode):
    values = torch.tensor([[1.0, 2.0, NAN], [INF, -INF, NAN]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    out = aggregate(values * 1.0, mask, mode)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(values.grad).all() and (values.grad[~mask] == 0).all()
    assert torch.isfinite(masked_mean(values, mask)) and masked_mean(values, mask).item() == 1.5
    whitened = masked_whiten(values.detach(), mask)
    assert torch.isfinite(whitened).all() and (whitened[~mask] == 0).all()


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimates_are_finite_for_any_log_ratio(estimator):
    logp = torch.full((1, 4), -1.0, requires_grad=True)
    ref = torch.tensor([[-1001.0, 999.0, -INF, -1.0]])
    kl = kl_estimate(logp, ref, estimator)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all(), (kl, logp.grad)
    assert logp.grad[0, :3].eq(0).all()  # beyond the +-20 bound the gradient is 0, as where a clip binds
