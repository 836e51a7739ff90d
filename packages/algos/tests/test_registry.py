"""tidal-algos is found by name through its `tidal` entry point, like a third-party plugin."""

from __future__ import annotations

import pytest
import torch

from tidal.algos import AdvantageInputs, LossInputs, ppo_loss
from tidal.core.plugins import Registry


@pytest.fixture(scope="module")
def reg():
    return Registry()


def test_every_loss_and_estimator_is_registered(reg):
    assert set(reg.names("policy_loss")) >= {"ppo", "gspo", "cispo", "reinforce", "distillation", "value"}
    assert set(reg.names("advantage_estimator")) >= {"grpo", "dr_grpo", "rloo", "opo", "reinforce_pp", "gae"}
    assert set(reg.names("group_filter")) >= {"zero_variance", "length"}
    assert reg.provider("policy_loss", "ppo") == "algos"


def test_loss_by_name_equals_direct_call(reg):
    torch.manual_seed(0)
    old = -torch.rand(2, 3)
    inp = LossInputs(logprobs=old + 0.3 * torch.randn(2, 3), behaviour_logprobs=old,
                     advantages=torch.randn(2, 3), mask=torch.ones(2, 3, dtype=torch.bool))
    by_name = reg.create("policy_loss", "ppo", clip_high=0.28, agg="seq-mean-token-mean")
    assert by_name(inp).loss.item() == ppo_loss(inp, clip_high=0.28, agg="seq-mean-token-mean").loss.item()


def test_unknown_loss_option_is_named(reg):
    with pytest.raises(TypeError, match="ppo_loss has no option.*clip_hi.*options are: clip_low, clip_high"):
        reg.create("policy_loss", "ppo", clip_hi=0.3)


def test_estimator_by_name(reg):
    mask = torch.ones(4, 2, dtype=torch.bool)
    batch = AdvantageInputs(rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), mask=mask, group_index=torch.tensor([0, 0, 1, 1]))
    out = reg.create("advantage_estimator", "rloo")(batch)
    assert out.advantages.tolist() == [[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]]
    gae = reg.create("advantage_estimator", "gae", gamma=1.0, lam=1.0)(
        AdvantageInputs(rewards=torch.tensor([1.0]), mask=torch.ones(1, 2, dtype=torch.bool), values=torch.zeros(1, 2))
    )
    assert gae.advantages.tolist() == [[1.0, 1.0]] and gae.returns.tolist() == [[1.0, 1.0]]
    with pytest.raises(ValueError, match="needs AdvantageInputs.values"):
        reg.create("advantage_estimator", "gae")(AdvantageInputs(rewards=torch.tensor([1.0]), mask=mask[:1]))
