"""The learner's view of the off-policy objectives: OAPL's pairings are refused at build time, naming
the fields and what to set, and the learner normalises OAPL's step by sequences (its stated
aggregation); M2PO, TOPR and IcePop build from a recipe like any other plugin."""

from __future__ import annotations

import pytest

from tidal.core.config import PluginRef
from tidal.core.errors import ConfigError
from tidal.integration.learner.objective import Objective
from tidal.integration.learner.trainer import _default_agg
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


# ------------------------------------------------- lag_logprobs = "learner": the anchor recomputed


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("lagged") / "policy", seed=3)


def lagged_batch(vocab: int, version: int):
    """Two groups of four whose sampler logprobs are far from the tiny model's (a sampler-vs-learner
    mismatch of ~1 nat per token), all sampled by `version`."""
    import numpy as np

    from tidal.integration.learner.data import Sample

    rng = np.random.default_rng(2)
    return [Sample(id=str(i), group_id=str(i // 4), prompt=rng.integers(3, vocab, 4).astype(np.int32),
                   completion=rng.integers(3, vocab, 5).astype(np.int32),
                   logprobs=(-np.log(vocab) + rng.uniform(-2, 2, 5)).astype(np.float32),
                   versions=np.full(5, version, np.int32), reward=float(i % 2), loss_mask=np.ones(5, bool))
            for i in range(8)]


def lagged_trainer(policy, lag_logprobs: str, loss: str = "oapl"):
    from tidal.integration.learner.backends import SingleBackend
    from tidal.integration.learner.trainer import Trainer
    from tidal.learner.config import BackendConfig, OptimConfig

    be = SingleBackend(str(policy), BackendConfig(optim=OptimConfig(lr=1e-2)))
    advantage = "oapl" if loss == "oapl" else "grpo"
    cfg = TrainConfig(loss=PluginRef(name=loss), advantage=PluginRef(name=advantage), lag_logprobs=lag_logprobs,
                      lag_snapshots=1)
    return be, Trainer(be, cfg)


def test_the_learner_recomputes_the_anchor_with_the_weights_it_published(policy):
    """With lag_logprobs = "learner", a batch of the published version anchors exactly to the current
    weights (ratio 1, whatever the sampler recorded); after two steps unpublished it anchors to the
    published ones (ratio != 1); a version no longer kept falls back to the sampler's, counted."""
    be, trainer = lagged_trainer(policy, "learner")
    vocab = be.model.config.vocab_size
    m = trainer.step(lagged_batch(vocab, 0))  # version 0: the starting weights, kept at construction
    assert m["ratio/mean"] == pytest.approx(1.0, abs=1e-6) and m["staleness/lag_logprobs_from_sampler"] == 0.0
    trainer.published(1)
    m = trainer.step(lagged_batch(vocab, 1))
    assert m["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    m = trainer.step(lagged_batch(vocab, 1))  # the weights moved since version 1 was published
    assert abs(m["ratio/mean"] - 1.0) > 1e-4 and m["staleness/lag_logprobs_from_sampler"] == 0.0
    assert sorted(trainer.lagged) == [1]  # lag_snapshots = 1: version 0's copy is gone
    m = trainer.step(lagged_batch(vocab, 0))
    assert m["staleness/lag_logprobs_from_sampler"] == pytest.approx(1.0)


def test_the_sampler_anchor_is_the_default(policy):
    be, trainer = lagged_trainer(policy, "sampler")
    m = trainer.step(lagged_batch(be.model.config.vocab_size, 0))
    assert abs(m["ratio/mean"] - 1.0) > 1e-2 and not trainer.lagged
    assert "staleness/lag_logprobs_from_sampler" not in m


def test_lagged_logprobs_with_a_proximal_correction_is_refused(policy):
    from tidal.integration.learner.backends import SingleBackend
    from tidal.integration.learner.trainer import Trainer
    from tidal.learner.config import BackendConfig

    be = SingleBackend(str(policy), BackendConfig())
    with pytest.raises(ValueError, match="proximal policy: choose one"):
        Trainer(be, TrainConfig(correction=PluginRef(name="decoupled_ppo"), lag_logprobs="learner"))


# ------------------------------------------------- ReMax: the greedy member is read, never trained


def remax_batch(vocab: int):
    """Two groups of four; the last member of each is the greedy baseline, as the rollout worker sends it
    (loss_mask 0, sampled at temperature 0, BASELINE_KEY in its metadata alone)."""
    import numpy as np

    from tidal.core.arrays import Array
    from tidal.core.protocol import BASELINE_KEY, SamplingParams, Trajectory
    from tidal.integration.learner.data import Sample

    rng = np.random.default_rng(5)
    out = []
    for i in range(8):
        greedy = i % 4 == 3
        t = Trajectory(id=f"s{i}", group_id=f"g{i // 4}", sample_index=i % 4, task="toy",
                       prompt_ids=Array.from_numpy(rng.integers(3, vocab, 4).astype(np.int32)),
                       completion_ids=Array.from_numpy(rng.integers(3, vocab, 5).astype(np.int32)),
                       logprobs=Array.from_numpy(np.full(5, -np.log(vocab), np.float32)),
                       versions=Array.from_numpy(np.zeros(5, np.int32)),
                       reward=[1.0, 0.0, 0.0, 0.5][i % 4] + i // 4 * 0.25, finish_reason="length",
                       loss_mask=Array.from_numpy(np.zeros(5, np.uint8)) if greedy else None,
                       metadata={BASELINE_KEY: "greedy"} if greedy else {},
                       sampling=SamplingParams(temperature=0.0 if greedy else 1.0))
        out.append(Sample.from_trajectory(t))
    return out


def test_remax_reads_the_greedy_members_reward_and_trains_the_others(policy):
    from tidal.integration.learner.backends import SingleBackend
    from tidal.integration.learner.trainer import Trainer
    from tidal.learner.config import BackendConfig

    be = SingleBackend(str(policy), BackendConfig())
    trainer = Trainer(be, TrainConfig(loss=PluginRef(name="reinforce"), advantage=PluginRef(name="remax")))
    batch = remax_batch(be.model.config.vocab_size)
    assert [s.baseline for s in batch] == [False, False, False, True] * 2
    prepared = trainer.prepare(batch)
    assert [s.id for s in prepared.samples] == ["s0", "s1", "s2", "s4", "s5", "s6"]  # greedy members left out
    # A = r - r_greedy of the group: group 0 (0.5) 0.5, -0.5, -0.5; group 1 (0.75) the same
    assert [round(float(a[0]), 6) for a in prepared.advantages] == [0.5, -0.5, -0.5] * 2
    m = trainer.step(prepared)  # a greedy member would be refused by the sampling check: it never gets there
    assert m["train/sequences"] == 6.0


def test_greedy_members_with_another_advantage_are_refused(policy):
    from tidal.integration.learner.backends import SingleBackend
    from tidal.integration.learner.trainer import Trainer
    from tidal.learner.config import BackendConfig

    be = SingleBackend(str(policy), BackendConfig())
    trainer = Trainer(be, TrainConfig(advantage=PluginRef(name="grpo")))
    with pytest.raises(ValueError, match=r"greedy baseline members .*which advantage 'grpo' does not read.*"
                                         r"learner.train.advantage = \{ name = \"remax\" \}"):
        trainer.prepare(remax_batch(be.model.config.vocab_size))
