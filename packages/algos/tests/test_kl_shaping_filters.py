"""KL estimators, entropy, DAPO shaping and group filters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tidal.algos import (
    LengthFilter,
    ZeroVarianceFilter,
    entropy_from_logits,
    has_reward_variance,
    kl_estimate,
    kl_penalty,
    overlong_penalty,
)
from tidal.core.arrays import Array
from tidal.core.testing import make_trajectory


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    log_r = math.log(0.5)  # ref / pi
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-log_r)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * log_r**2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx((0.5 - 1) - log_r)
    big = kl_estimate(torch.tensor([-30.0]), torch.tensor([-1.0]), "low-var-k3")
    assert big.item() == 10.0
    with pytest.raises(ValueError, match="choose one of k1"):
        kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_on_a_known_distribution():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    true_kl = float((p * (p / q).log()).sum())
    gen = torch.Generator().manual_seed(0)
    x = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    logp, logq = p.log()[x], q.log()[x]
    for est in ("k1", "k3"):
        assert kl_estimate(logp, logq, est).mean().item() == pytest.approx(true_kl, abs=5e-3)
    # k2 is biased but close for nearby distributions, and never negative
    assert (kl_estimate(logp, logq, "k2") >= 0).all() and (kl_estimate(logp, logq, "k3") >= 0).all()


def test_kl_penalty_is_detached_and_masked():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    pen = kl_penalty(logp, torch.tensor([[-1.5, -2.0]]), torch.tensor([[1, 0]]).bool(), beta=0.1)
    assert not pen.requires_grad
    assert pen[0, 0].item() == pytest.approx(0.1 * 0.5) and pen[0, 1].item() == 0


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(2, 8)).tolist() == pytest.approx([math.log(8)] * 2)
    assert entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)


def test_dapo_overlong_penalty():
    lengths = torch.tensor([10, 16, 18, 20, 21])
    pen = overlong_penalty(lengths, max_length=20, cache=4)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache must be"):
        overlong_penalty(lengths, max_length=20, cache=0)


def _group(rewards, lengths=None):
    out = []
    for i, r in enumerate(rewards):
        tr = make_trajectory(i)
        tr.reward = r
        if lengths:
            tr.completion_ids = Array.from_numpy(np.zeros(lengths[i], np.int32))
        out.append(tr)
    return out


def test_zero_variance_filter():
    keep = ZeroVarianceFilter()
    assert not keep(_group([1.0, 1.0, 1.0]))
    assert keep(_group([1.0, 0.0, 1.0]))
    assert not ZeroVarianceFilter(tol=0.5)(_group([1.0, 0.8]))
    assert has_reward_variance([0.0, 1.0]) and not has_reward_variance([])


def test_length_filter():
    assert LengthFilter(max_tokens=10)(_group([0, 1], lengths=[5, 10]))
    assert not LengthFilter(max_tokens=10)(_group([0, 1], lengths=[5, 11]))
    assert LengthFilter(max_tokens=10, require_all=True)(_group([0, 1], lengths=[5, 11]))
    assert not LengthFilter(min_tokens=6)(_group([0, 1], lengths=[5, 11]))


def test_filters_do_not_need_torch():
    import subprocess
    import sys

    code = (
        "import sys; from tidal.core.plugins import Registry; r = Registry();"
        "f = r.create('group_filter', 'zero_variance'); assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
