"""A step whose loss or gradient is not finite changes nothing and is counted; the next step trains.

Two ways in, through the learner's Trainer and the single backend on a tiny model: a NaN reward (its
group's advantages, hence the loss, are NaN) and a finite loss whose gradient is made NaN on one
parameter (the norm check catches it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tidal.core.config import PluginRef
from tidal.integration.learner.backends import SingleBackend
from tidal.integration.learner.data import Sample
from tidal.integration.learner.trainer import Trainer
from tidal.learner.config import BackendConfig, OptimConfig, TrainConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("nonfinite") / "policy", seed=3)


def batch(vocab: int, nan_reward: bool = False) -> list[Sample]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(8):
        t = int(rng.integers(2, 8))
        reward = float("nan") if nan_reward and i == 0 else float(i % 2)
        out.append(Sample(id=f"t{i}", group_id=str(i // 4), prompt=rng.integers(3, vocab, 4).astype(np.int32),
                          completion=rng.integers(3, vocab, t).astype(np.int32),
                          logprobs=np.full(t, -np.log(vocab), np.float32), versions=np.zeros(t, np.int32),
                          reward=reward, loss_mask=np.ones(t, bool)))
    return out


def weights(be) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in be.named_weights()}


def moved(before: dict[str, torch.Tensor], be) -> float:
    return max((v - before[k]).abs().max().item() for k, v in be.named_weights())


def make(policy) -> tuple[SingleBackend, Trainer]:
    be = SingleBackend(str(policy), BackendConfig(optim=OptimConfig(lr=1e-3)))
    return be, Trainer(be, TrainConfig(loss=PluginRef(name="ppo"), correction=PluginRef(name="tis")))


def test_a_nan_loss_is_skipped_and_counted_and_the_run_goes_on(policy):
    be, trainer = make(policy)
    vocab = be.model.config.vocab_size
    before = weights(be)
    m = trainer.step(batch(vocab, nan_reward=True))
    assert math.isnan(m["loss/total"])
    assert m["train/skipped_nonfinite"] == 1.0 and m["train/skipped_steps_total"] == 1.0
    assert moved(before, be) == 0.0  # nothing stepped: not the weights, not Adam's moments
    assert all(not s for s in be.optimizer.state.values())
    assert be.scheduler.last_epoch == 0  # nor the LR schedule
    m = trainer.step(batch(vocab))
    assert math.isfinite(m["loss/total"]) and m["train/skipped_nonfinite"] == 0.0
    assert m["train/skipped_steps_total"] == 1.0
    assert moved(before, be) > 0.0


def test_a_nan_gradient_under_a_finite_loss_is_skipped(policy):
    be, trainer = make(policy)
    vocab = be.model.config.vocab_size
    param = next(p for p in be.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: g * float("nan"))
    before = weights(be)
    m = trainer.step(batch(vocab))
    hook.remove()
    assert math.isfinite(m["loss/total"]) and not math.isfinite(m["train/grad_norm"])
    assert m["train/skipped_nonfinite"] == 1.0
    assert moved(before, be) == 0.0
    assert all(p.grad is None for p in be.model.parameters())  # the NaN gradient does not leak into the next step
    m = trainer.step(batch(vocab))
    assert m["train/skipped_nonfinite"] == 0.0 and math.isfinite(m["train/grad_norm"])
    assert moved(before, be) > 0.0
