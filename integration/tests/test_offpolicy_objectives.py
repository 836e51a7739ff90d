"""The learner's view of the off-policy objectives: OAPL's pairings are refused at build time, naming
the fields and what to set, and the learner normalises OAPL's step by sequences (its stated
aggregation); M2PO, TOPR and IcePop build from a recipe like any other plugin."""

from __future__ import annotations

import pytest

from tidal.core.config import PluginRef
from tidal.core.errors import ConfigError
from tidal.integration.learner.trainer import Objective, _default_agg
from tidal.learner.config import TrainConfig


def build(loss: str, advantage: str = "grpo", correction: str | None = None, **options) -> Objective:
    return Objective.build(TrainConfig(loss=PluginRef(name=loss, options=options),
                                       advantage=PluginRef(name=advantage),
                                       correction=PluginRef(name=correction) if correction else None))


def test_oapl_builds_with_its_advantage():
    objective = build("oapl", "oapl", beta=0.5)
    assert objective.correction is None
    assert _default_agg(objective.loss) == "seq-mean-token-sum"  # a mean over sequences: shares by sequences


def test_oapl_with_another_advantage_is_refused():
    with pytest.raises(ConfigError, match=r"train.loss.name = 'oapl' needs train.advantage.name = 'oapl'.*"
                                          r"got 'grpo': set train.advantage.name = 'oapl'") as e:
        build("oapl", "grpo")
    assert e.value.field == "train.advantage.name"


def test_oapl_with_a_correction_is_refused():
    with pytest.raises(ConfigError, match=r"train.loss.name = 'oapl' takes no staleness correction \(OAPL is "
                                          r"built for off-policy data.*train.correction.name = 'tis': remove "
                                          r"train.correction") as e:
        build("oapl", "oapl", "tis")
    assert e.value.field == "train.correction"


def test_the_oapl_advantage_serves_other_losses():
    """A soft-max group baseline is a baseline like GRPO's mean: a policy-gradient loss may use it."""
    objective = build("reinforce", "oapl", "icepop")
    assert objective.correction is not None


@pytest.mark.parametrize(("loss", "agg"), [("m2po", "token-mean"), ("topr", "seq-mean-token-mean"),
                                           ("ppo", "token-mean")])
def test_other_losses_keep_their_agg_default(loss, agg):
    assert _default_agg(build(loss, correction="icepop").loss) == agg


def test_an_explicit_agg_wins():
    assert _default_agg(build("topr", agg="token-mean").loss) == "token-mean"
