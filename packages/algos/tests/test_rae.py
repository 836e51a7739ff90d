"""RAE (role-conditioned advantages, "rae") against baselines worked out by hand over several batches."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from tidal.algos.estimators import AdvantageInputs, RoleBaselineEstimator
from tidal.core.plugins import registry


def call(est: RoleBaselineEstimator, rewards: list[float], keys: list[str] | None, width: int = 3) -> list[float]:
    """The estimator's sequence advantages (its token advantages on an all-ones mask, first column)."""
    out = est(AdvantageInputs(rewards=torch.tensor(rewards, dtype=torch.float64),
                              mask=torch.ones(len(rewards), width, dtype=torch.bool), role_keys=keys))
    assert torch.allclose(out.advantages, out.advantages[:, :1].expand(-1, width), rtol=0, atol=0, equal_nan=True)
    return out.advantages[:, 0].tolist()


def test_two_batches_by_hand_baselines_before_the_batch_then_updated_by_its_mean():
    est = registry.create("advantage_estimator", "rae", decay=0.5)
    keys = ["nim/first", "nim/second"] * 4
    # batch 1: first seen, each key starts at its batch's mean (first 0.5, second -0.5)
    assert call(est, [1, -1, 1, -1, -1, 1, 1, -1], keys) == [0.5, -0.5, 0.5, -0.5, -1.5, 1.5, 0.5, -0.5]
    assert est.state_dict() == {"nim/first": {"baseline": 0.5, "var": 0.75, "count": 4},
                                "nim/second": {"baseline": -0.5, "var": 0.75, "count": 4}}
    # batch 2: A = r - (0.5 | -0.5), the baselines before it; then b = 0.5 b + 0.5 mean = 0.5 * 0.5 + 0.5 * -0.5
    assert call(est, [1, -1, -1, 1, -1, 1, -1, 1], keys) == [0.5, -0.5, -1.5, 1.5, -1.5, 1.5, -1.5, 1.5]
    # var: 0.5 * 0.75 + 0.5 * 0.75 + 0.5 * 0.5 * (-0.5 - 0.5) ** 2 (law of total variance)
    assert est.state_dict() == {"nim/first": {"baseline": 0.0, "var": 1.0, "count": 8},
                                "nim/second": {"baseline": 0.0, "var": 1.0, "count": 8}}
    assert call(est, [1, 1], ["nim/first", "nim/second"]) == [1.0, 1.0]  # b = 0 now


def test_keys_are_independent_and_a_new_key_starts_at_its_batch_mean():
    est = RoleBaselineEstimator(decay=0.75)
    call(est, [1.0, 0.0], ["a/first", "a/second"])
    # a key absent from a batch keeps its baseline; a new one starts at its own mean
    assert call(est, [0.0, 4.0, 2.0], ["a/first", "b/first", "b/first"]) == [-1.0, 1.0, -1.0]
    state = est.state_dict()
    assert state["a/first"]["baseline"] == 0.75 and state["a/second"] == {"baseline": 0.0, "var": 0.0, "count": 1}
    assert state["b/first"] == {"baseline": 3.0, "var": 1.0, "count": 2}
    # the same key in another task is another key
    assert call(est, [1.0, 1.0], ["a/first", "c/first"]) == [0.25, 0.0]


def test_the_state_round_trips_through_json_and_continues_identically():
    est = RoleBaselineEstimator(decay=0.9, normalize=True)
    rng = random.Random(0)
    keys = ["g/first", "g/second", "h/first"] * 3
    for _ in range(3):
        call(est, [rng.uniform(-1, 1) for _ in keys], keys)
    again = RoleBaselineEstimator(decay=0.9, normalize=True)
    again.load_state_dict(json.loads(json.dumps(est.state_dict())))
    assert again.state_dict() == est.state_dict()
    rewards = [rng.uniform(-1, 1) for _ in keys]
    assert call(again, rewards, keys) == call(est, rewards, keys)
    with pytest.raises(ValueError, match="RAE state of key 'g/first' must be"):
        again.load_state_dict({"g/first": {"baseline": 0.1}})


def test_it_refuses_samples_without_role_keys():
    est = RoleBaselineEstimator()
    with pytest.raises(ValueError, match=r"needs AdvantageInputs.role_keys.*metadata tidal.role"):
        call(est, [1.0, 0.0], None)
    with pytest.raises(ValueError, match="one key per sample: 1 keys for 2 rewards"):
        call(est, [1.0, 0.0], ["a/first"])
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\), got 1.0"):
        RoleBaselineEstimator(decay=1.0)
    with pytest.raises(ValueError, match="normalize needs decay > 0"):
        RoleBaselineEstimator(decay=0.0, normalize=True)


def test_the_order_of_the_samples_changes_nothing():
    rng = random.Random(3)
    batches = [[(rng.choice(["x/first", "x/second", "y/first"]), rng.uniform(-3, 3)) for _ in range(11)]
               for _ in range(4)]
    results = []
    for seed in range(3):
        est, shuffled = RoleBaselineEstimator(decay=0.8, normalize=True), random.Random(seed)
        advantages = {}
        for b, batch in enumerate(batches):
            order = list(range(len(batch)))
            shuffled.shuffle(order)
            a = call(est, [batch[i][1] for i in order], [batch[i][0] for i in order])
            advantages.update({(b, i): a[j] for j, i in enumerate(order)})
        results.append((advantages, est.state_dict()))
    assert results[0] == results[1] == results[2]  # exactly: sums are exact (math.fsum)


def test_sync_sees_every_ranks_rewards_and_two_shares_equal_one_batch():
    """Two data-parallel shares whose `sync` joins their rewards (as the learner's all-gather does) end with
    the baselines of one estimator that saw the whole batch, and give its advantages."""
    keys = ["g/first", "g/second", "g/first", "g/second", "h/first", "g/first"]
    batches = [[0.5, -0.5, 1.0, -1.0, 0.25, 0.0], [1.0, 0.0, -1.0, 0.5, 0.75, 0.25]]
    whole, shares = RoleBaselineEstimator(decay=0.6), [RoleBaselineEstimator(decay=0.6) for _ in range(2)]
    split = [[0, 1, 4], [2, 3, 5]]  # rank 1 never sees h/first
    for rewards in batches:
        # the all-gather: every rank's share (key -> its rewards) seen by every rank
        gathered: list[dict[str, list[float]]] = [{}, {}]
        for rank in range(2):
            for i in split[rank]:
                gathered[rank].setdefault(keys[i], []).append(rewards[i])
        joined = {k: [v for part in gathered for v in part.get(k, [])] for part in gathered for k in part}
        for est in shares:
            est.sync = lambda mine, joined=joined: joined
        expect = call(whole, rewards, keys)
        for rank, est in enumerate(shares):
            got = call(est, [rewards[i] for i in split[rank]], [keys[i] for i in split[rank]])
            assert got == pytest.approx([expect[i] for i in split[rank]], abs=1e-12)
    assert shares[0].state_dict() == shares[1].state_dict() == whole.state_dict()


def test_an_empty_share_still_updates_from_the_others():
    est = RoleBaselineEstimator(decay=0.5)
    est.sync = lambda mine: {"g/first": [1.0, 3.0]}
    out = est(AdvantageInputs(rewards=torch.zeros(0), mask=torch.zeros(0, 0, dtype=torch.bool), role_keys=[]))
    assert out.advantages.shape == (0, 0) and est.state_dict()["g/first"] == {"baseline": 2.0, "var": 1.0, "count": 2}


def test_normalize_divides_by_the_running_std_after_the_batch():
    est = RoleBaselineEstimator(decay=0.5, normalize=True)
    # batch 1: GRPO over the key with the population std: (r - 0.5) / sqrt(0.75)
    first = call(est, [1, 1, -1, 1], ["k/a"] * 4)
    assert first == pytest.approx([0.5 / (math.sqrt(0.75) + 1e-6)] * 2 + [-1.5 / (math.sqrt(0.75) + 1e-6)]
                                  + [0.5 / (math.sqrt(0.75) + 1e-6)])
    # batch 2, every reward 5 (far from the baseline 0.5): var = 0.5 * 0.75 + 0 + 0.25 * 4.5 ** 2, not ~0
    second = call(est, [5.0, 5.0], ["k/a"] * 2)
    assert second == pytest.approx([4.5 / (math.sqrt(0.375 + 0.25 * 4.5 ** 2) + 1e-6)] * 2)
    assert abs(second[0]) <= math.sqrt(2 * 2 / 0.5 + 2 / 0.25)  # the documented bound, n = 2


def test_a_non_finite_reward_updates_nothing():
    est = RoleBaselineEstimator(decay=0.5)
    call(est, [1.0], ["g/first"])
    a = call(est, [math.nan, 3.0], ["g/first", "g/first"])
    assert math.isnan(a[0]) and a[1] == 2.0
    assert est.state_dict()["g/first"] == {"baseline": 2.0, "var": 1.0, "count": 2}
