"""RAE (advantage "rae") in the learner: each sample's role key from its trajectory, the advantages a
step trains on worked out by hand, the baselines kept by the checkpoint and resumed, and two data-parallel
ranks (gloo processes) that keep the baselines one process would."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tidal.algos.estimators import AdvantageInputs, RoleBaselineEstimator
from tidal.core.arrays import Array
from tidal.core.config import PluginRef
from tidal.core.episodes import ROLE_KEY
from tidal.core.protocol import Batch, SamplingParams, Trajectory
from tidal.core.testing import free_endpoint
from tidal.integration.learner.backends import SingleBackend
from tidal.integration.learner.build import build_learner
from tidal.integration.learner.data import Sample
from tidal.integration.learner.trainer import Trainer
from tidal.learner import loop
from tidal.learner.config import BackendConfig, LearnerConfig, TrainConfig, WeightsConfig
from tidal.learner.sources import BatchRecorder

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: the backend tests' helpers are not importable
from learner_rank import batch  # their synthetic batches
from test_learner_backends import run  # learner_rank.py on gloo ranks

pytestmark = pytest.mark.timeout(300)

# the first player's reward in each of a batch's four games of nim; the second's is its negative (zero-sum)
FIRST = [[1.0, 1.0, -1.0, 1.0], [1.0, -1.0, -1.0, -1.0], [1.0, 1.0, 1.0, -1.0]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("rae") / "model", seed=3)


def trajectory(b: int, game: int, role: str, reward: float, task: str = "nim") -> Trajectory:
    def arr(x: list, dt: type) -> Array:
        return Array.from_numpy(np.asarray(x, dt))

    return Trajectory(id=f"b{b}-g{game}-{role}", group_id=f"b{b}-g{game}", sample_index=int(role == "second"),
                      task=task, prompt_ids=arr([3, 4, 5 + game], np.int32), completion_ids=arr([6 + b, 7, 8], np.int32),
                      logprobs=arr([-2.0] * 3, np.float32), versions=arr([0] * 3, np.int32), reward=reward,
                      finish_reason="stop", metadata={ROLE_KEY: role} if role else {}, sampling=SamplingParams())


def games(b: int) -> Batch:
    """Batch `b`: its four games, each a group of the first player's sample and the second's."""
    return Batch(batch_id=f"b{b}", rank=0, world_size=1, trajectories=[
        trajectory(b, g, role, r if role == "first" else -r) for g, r in enumerate(FIRST[b]) for role in ("first", "second")])


def test_a_sample_keys_its_role_by_its_task():
    assert Sample.from_trajectory(trajectory(0, 0, "second", 1.0, task="kuhn")).role_key == "kuhn/second"
    assert Sample.from_trajectory(trajectory(0, 0, "", 1.0)).role_key == ""  # not a multi-role episode


def test_rae_refuses_samples_without_a_role(model):
    trainer = Trainer(SingleBackend(str(model), BackendConfig()), TrainConfig(advantage=PluginRef(name="rae")))
    samples = [Sample.from_trajectory(trajectory(0, g, "", 1.0)) for g in range(2)]
    with pytest.raises(ValueError, match=r"trajectory b0-g0- \(and 1 more this step\) carries none \(metadata "
                                         r"'tidal.role'"):
        trainer.step(samples)


def test_rae_advantages_wait_for_the_step_not_the_prepared_batch(model):
    """The learner prepares the next batch while one trains: RAE's baselines move only when a batch trains."""
    trainer = Trainer(SingleBackend(str(model), BackendConfig()), TrainConfig(advantage=PluginRef(name="rae")))
    prepared = trainer.prepare([Sample.from_trajectory(t) for t in games(0).trajectories])
    assert prepared.advantages is None and trainer.state_dict() == {"advantage": {}}
    trainer.step(prepared)
    assert trainer.state_dict()["advantage"]["nim/first"] == {"baseline": 0.5, "var": 0.75, "count": 4}


def learner(tmp_path: Path, model: Path, steps: int) -> tuple[Any, list[dict[str, list[float]]]]:
    """A learner rank replaying the recorded batches with RAE (decay 0.5), checkpointing every step; and
    the advantages of each step it trains, per sample id."""
    cfg = LearnerConfig(model=str(model), source=PluginRef(name="replay", options={"path": str(tmp_path / "rec")}),
                        publish=free_endpoint(), weights=WeightsConfig(every=0), checkpoint_dir=str(tmp_path / "ckpt"),
                        checkpoint_every=1, max_steps=steps,
                        train=TrainConfig(advantage=PluginRef(name="rae", options={"decay": 0.5})))
    built = build_learner(cfg)
    seen: list[dict[str, list[float]]] = []
    advantages = built.trainer.advantages

    def spy(samples, values=None):
        adv, ret = advantages(samples, values)
        seen.append({s.id: a.tolist() for s, a in zip(samples, adv, strict=True)})
        return adv, ret

    built.trainer.advantages = spy
    return built, seen


def expected(b: int, first: float, second: float) -> dict[str, list[float]]:
    """Batch `b`'s advantages, r - the role's baseline, on each of the 3 completion tokens."""
    return {f"b{b}-g{g}-{role}": [r - first if role == "first" else -r - second] * 3
            for g, r in enumerate(FIRST[b]) for role in ("first", "second")}


def test_rae_trains_on_baselines_per_role_and_resumes_them_from_the_checkpoint(model, tmp_path):
    rec = BatchRecorder(tmp_path / "rec", dp_rank=0)
    for b in range(3):
        rec.write(games(b))
    rec.close()
    first, seen = learner(tmp_path, model, steps=2)
    assert loop.run(first) == 0
    # batch 0: each role starts at its batch's mean (first 0.5, second -0.5); batch 1: the same baselines,
    # then b = 0.5 * b + 0.5 * (batch 1's mean: first -0.5, second 0.5) = 0 for both
    assert seen == [expected(0, 0.5, -0.5), expected(1, 0.5, -0.5)]
    state = {"nim/first": {"baseline": 0.0, "var": 1.0, "count": 8},
             "nim/second": {"baseline": 0.0, "var": 1.0, "count": 8}}
    progress = json.loads((tmp_path / "ckpt" / "latest" / "progress.json").read_text())
    assert progress["trainer"] == {"advantage": state}

    again, seen = learner(tmp_path, model, steps=3)
    assert again.trainer.estimator.state_dict() == state  # restored with the checkpoint
    assert loop.run(again) == 0
    assert seen == [expected(2, 0.0, 0.0)]  # a fresh estimator would have taken batch 2's means (0.5, -0.5)


def test_two_ranks_keep_the_baselines_of_one_process(model, tmp_path):
    """learner_rank.py with --advantage rae on 2 gloo ranks: 3 steps of 3, 1 and 4 groups (the second
    leaves rank 1 an empty share, which still joins the gather), role keys game<group // 2>/<first|second>
    shared between the ranks' shares. Both ranks end with the baselines one estimator gets from the whole
    batches, exactly (its sums are exact whatever the split)."""
    run("single", model, tmp_path / "two.safetensors", "--advantage", "rae", "--groups", "3,1,4",
        "--state", str(tmp_path / "two.json"), world=2)
    whole = RoleBaselineEstimator()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    for step, groups in enumerate([3, 1, 4]):
        samples = batch(step, vocab, groups=groups)
        whole(AdvantageInputs(rewards=torch.tensor([s.reward for s in samples]),
                              mask=torch.ones(len(samples), 1, dtype=torch.bool),
                              role_keys=[s.role_key for s in samples]))
    assert set(whole.keys) == {"game0/first", "game0/second", "game1/first", "game1/second"}
    one = {"advantage": whole.state_dict()}
    assert json.loads((tmp_path / "two.json").read_text()) == json.loads((tmp_path / "two.json.rank1").read_text()) == one
