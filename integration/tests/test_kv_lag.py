"""KV staleness through the learner's Trainer: tokens sampled over a KV cache more than `max_kv_lag`
versions behind the learner leave the loss (correction kv_lag_mask), counted in the step's metrics; the
step is the one that trains on the other tokens alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.core.config import PluginRef
from tidal.core.protocol import NO_VERSION
from tidal.integration.learner.backends import SingleBackend
from tidal.integration.learner.data import Sample
from tidal.integration.learner.trainer import Trainer
from tidal.learner.config import BackendConfig, OptimConfig, TrainConfig

pytestmark = pytest.mark.timeout(300)

LEARNER = 5  # the learner's version during the step


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("kvlag") / "policy", seed=3)


def batch(vocab: int, *, kv: bool = True, stale_as_loss_mask: bool = False) -> tuple[list[Sample], int]:
    """Two groups of four, sampled by version 4; in "continue" mode the second half of each completion
    attended to version 2's KV (lag 3), the first half to version 4's (lag 1). The last token of each is an
    observation (NO_VERSION, not trained). `stale_as_loss_mask`: those tokens untrained instead, and no
    kv_versions. Returns the samples and the number of stale trained tokens."""
    rng = np.random.default_rng(4)
    out, stale = [], 0
    for i in range(8):
        t = 6
        versions = np.full(t, 4, np.int32)
        versions[-1] = NO_VERSION
        kv_versions = np.where(np.arange(t) >= t // 2, 2, 4).astype(np.int32)
        kv_versions[-1] = NO_VERSION
        mask = versions > NO_VERSION
        old = mask & (kv_versions < 4)
        stale += int(old.sum())
        out.append(Sample(id=str(i), group_id=str(i // 4), prompt=rng.integers(3, vocab, 4).astype(np.int32),
                          completion=rng.integers(3, vocab, t).astype(np.int32),
                          logprobs=(-np.log(vocab) + rng.uniform(-1, 1, t)).astype(np.float32),
                          versions=versions, reward=float(i % 4 in (0, 3)) + 0.1 * i,
                          loss_mask=mask & ~old if stale_as_loss_mask else mask,
                          kv_versions=kv_versions if kv and not stale_as_loss_mask else None))
    return out, stale


def step(policy, samples: list[Sample]) -> tuple[torch.Tensor, dict[str, float]]:
    be = SingleBackend(str(policy), BackendConfig(optim=OptimConfig(lr=1e-3)))
    cfg = TrainConfig(correction=PluginRef(name="kv_lag_mask", options={"max_kv_lag": 2}))
    trainer = Trainer(be, cfg)
    trainer.at_version(LEARNER)
    grads: list[torch.Tensor] = []
    trainer.before_update = lambda: grads.append(
        torch.cat([p.grad.flatten() for p in be.model.parameters() if p.grad is not None]).clone())
    metrics = trainer.step(samples)
    return grads[0], metrics


def test_tokens_over_an_old_kv_cache_are_masked_and_counted(policy):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(policy).vocab_size
    samples, stale = batch(vocab)
    trained = sum(int(s.loss_mask.sum()) for s in samples)
    g_kv, m = step(policy, samples)
    assert m["staleness/is/kv_lag_masked_frac"] == pytest.approx(stale / trained)
    # the same step as one that never trained on those tokens: the loss is a token mean over the batch's
    # trained tokens, so the gradients differ by the ratio of the two counts
    g_masked, m_masked = step(policy, batch(vocab, stale_as_loss_mask=True)[0])
    assert "staleness/is/kv_lag_masked_frac" not in m_masked  # no kv_versions: the correction is the identity
    torch.testing.assert_close(g_kv * trained, g_masked * (trained - stale), rtol=1e-4, atol=1e-6)
    g_plain, _ = step(policy, batch(vocab, kv=False)[0])  # no producer recorded them: nothing masked
    assert (g_plain - g_kv).abs().max() > 1e-4
