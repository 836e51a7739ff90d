"""The self-play opponent samplers (tidal.integration.opponents): the pool picks with the probabilities
its rule says (a chi-square test over many seeded picks), its openskill ratings move the way results
say, every sampler's state survives a JSON round trip, and the plugins are built by name with their
options checked."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest

from tidal.core.errors import ConfigError
from tidal.core.plugins import registry
from tidal.integration.opponents import FixedSampler, LaggedSampler, MirrorSampler, PoolSampler

BETA = 25.0 / 6.0  # openskill's default beta, which its predict_win uses
# chi-square critical values at p = 0.001 by degrees of freedom (no scipy here)
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
LIVE = {"mu": 25.0, "sigma": 3.0}
POOL = [{"version": 0, "mu": 18.0, "sigma": 2.0}, {"version": 5, "mu": 22.0, "sigma": 2.5},
        {"version": 10, "mu": 25.0, "sigma": 3.0}, {"version": 15, "mu": 29.0, "sigma": 4.0}]


def known_pool(**options) -> PoolSampler:
    pool = PoolSampler(**options)
    pool.load({"sampler": "pool", "picks": [], "results": [], "live": LIVE, "pool": POOL})
    return pool


def expected(rule: str, weighting: str, live_prob: float) -> dict[str, float]:
    """The pick probabilities worked out here from the ratings, independently of the sampler."""
    weights = {}
    for s in POOL:
        z = (LIVE["mu"] - s["mu"]) / math.sqrt(2 * BETA**2 + LIVE["sigma"] ** 2 + s["sigma"] ** 2)
        p = 0.5 * (1 + math.erf(z / math.sqrt(2)))  # the live policy's chance to beat the snapshot
        weights[f"v{s['version']}"] = 1.0 if rule == "uniform" else p * (1 - p) if weighting == "variance" else (1 - p) ** 2
    total = sum(weights.values())
    return {"live": live_prob, **{k: (1 - live_prob) * w / total for k, w in weights.items()}}


def chi_square(counts: Counter, probs: dict[str, float]) -> float:
    n = sum(counts.values())
    assert set(counts) <= set(probs), f"picked opponents outside the distribution: {set(counts) - set(probs)}"
    return sum((counts[k] - n * p) ** 2 / (n * p) for k, p in probs.items())


@pytest.mark.parametrize(("rule", "weighting"), [("pfsp", "variance"), ("pfsp", "hard"), ("uniform", "variance")])
def test_pool_picks_follow_the_rule_probabilities_chi_square(rule, weighting):
    pool = known_pool(rule=rule, pfsp_weighting=weighting, live_prob=0.2)
    probs = expected(rule, weighting, 0.2)
    assert pool.distribution() == pytest.approx(probs, rel=1e-9)
    rng = random.Random(20240601)
    counts = Counter(pool.pick(live_version=20, rng=rng) for _ in range(20000))
    assert chi_square(counts, probs) < CHI2_CRITICAL_0_001[len(probs) - 1], (counts, probs)


def test_the_chi_square_test_tells_the_weightings_apart():
    rng = random.Random(7)
    hard = known_pool(pfsp_weighting="hard")
    counts = Counter(hard.pick(20, rng) for _ in range(20000))
    assert chi_square(counts, expected("pfsp", "variance", 0.2)) > CHI2_CRITICAL_0_001[4]
    assert chi_square(counts, expected("pfsp", "hard", 0.2)) < CHI2_CRITICAL_0_001[4]


def test_pfsp_weightings_favour_what_they_say():
    variance, hard = known_pool().distribution(), known_pool(pfsp_weighting="hard").distribution()
    assert max(variance, key=lambda k: (k != "live", variance[k])) == "v10"  # the equal-strength one
    assert max(hard, key=lambda k: (k != "live", hard[k])) == "v15"  # the strongest one
    assert known_pool(live_prob=0.0).pick(3, random.Random(0)) != "live"
    assert all(known_pool(live_prob=1.0).pick(3, random.Random(s)) == "live" for s in range(50))


def test_wins_raise_live_and_lower_the_snapshot_and_variance_weighs_it_less():
    pool = PoolSampler(every=5)
    pool.add(5)
    pool.add(10)  # both start from the live rating of the moment: equal strength
    start = pool.metrics()
    assert start["selfplay/rating/v5"] == start["selfplay/rating/v10"] == start["selfplay/rating/live"]
    pool.record("v5", [1.0, 1.0, 1.0])
    after = pool.metrics()
    assert after["selfplay/rating/live"] > start["selfplay/rating/live"]
    assert after["selfplay/rating/v5"] < start["selfplay/rating/v5"]
    assert after["selfplay/rating/v10"] == start["selfplay/rating/v10"]
    weights = pool.distribution()
    assert weights["v5"] < weights["v10"]

    pool.record("v10", [-1.0, -1.0])  # losses: the other way
    lost = pool.metrics()
    assert lost["selfplay/rating/live"] < after["selfplay/rating/live"]
    assert lost["selfplay/rating/v10"] > after["selfplay/rating/v10"]


def test_mirror_and_scripted_results_and_dropped_snapshots_move_no_rating():
    pool = PoolSampler(every=1, size=2)
    for v in (1, 2, 3):
        pool.add(v)
    state = pool.state()
    pool.record("live", [1.0, -1.0, 1.0])
    pool.record("scripted", [1.0])
    assert pool.state()["live"] == state["live"] and pool.state()["pool"] == state["pool"]
    pool.record("v1", [1.0, 1.0])  # v1 left the pool (size 2): ignored, metrics too
    assert {k: v for k, v in pool.state().items() if k != "results"} == {k: v for k, v in state.items()
                                                                          if k != "results"}
    assert pool.metrics()["selfplay/win_rate/vs_live"] == pytest.approx(2 / 3)
    assert "selfplay/win_rate/vs_pool" not in pool.metrics()
    pool.record("v3", [0.0, 1.0])
    assert pool.metrics()["selfplay/win_rate/vs_pool"] == 0.75  # a draw counts half


def test_new_snapshots_start_from_the_live_rating():
    pool = PoolSampler(every=1)
    pool.add(1)
    pool.record("v1", [1.0] * 5)
    pool.add(2)
    state = pool.state()
    assert state["pool"][1]["mu"] == state["live"]["mu"] and state["pool"][1]["sigma"] == state["live"]["sigma"]


def played(sampler, seed: int, n: int = 300) -> list[str]:
    """Picks, each followed by a made-up result, and the snapshots a run would add on the way."""
    rng, out = random.Random(seed), []
    for step in range(n):
        version = step // 3
        if step % 3 == 0 and sampler.keep(version):
            sampler.add(version)
        opponent = sampler.pick(version, rng)
        out.append(opponent)
        sampler.record(opponent, [rng.choice([1.0, -1.0, 0.0]) for _ in range(4)])
    return out


SAMPLERS = {"mirror": lambda: MirrorSampler(), "lagged": lambda: LaggedSampler(k=3, every=2),
            "pool": lambda: PoolSampler(every=4, size=5), "fixed": lambda: FixedSampler(opponent="v20"),
            "fixed-scripted": lambda: FixedSampler()}


@pytest.mark.parametrize("name", SAMPLERS)
def test_state_round_trip_through_json_gives_the_same_picks_and_metrics(name):
    first = SAMPLERS[name]()
    played(first, seed=1)
    saved = json.loads(json.dumps(first.state()))
    second = SAMPLERS[name]()
    second.load(saved)
    assert second.state() == first.state()
    assert second.metrics() == first.metrics()
    assert played(second, seed=2) == played(first, seed=2)
    assert second.state() == first.state() and second.metrics() == first.metrics()
    assert second.snapshots() == first.snapshots()


def test_another_samplers_state_is_refused():
    with pytest.raises(ValueError, match="sampler 'mirror'.*this run's is 'pool'"):
        PoolSampler().load(MirrorSampler().state())


def test_lagged_picks_the_snapshot_k_versions_behind():
    lagged = LaggedSampler(k=4, every=2)
    assert [v for v in range(7) if lagged.keep(v)] == [0, 2, 4, 6]
    rng = random.Random(0)
    lagged.add(0)
    assert lagged.pick(2, rng) == "live"  # nothing 4 versions back yet
    for v in (2, 3, 4):
        lagged.add(v)  # 3 is not kept
    assert lagged.pick(4, rng) == "v0"
    lagged.add(6)
    assert lagged.pick(7, rng) == "v2"
    assert lagged.snapshots() == [2, 4, 6]
    lagged.add(8)
    assert lagged.pick(9, rng) == "v4"
    assert lagged.snapshots() == [4, 6, 8]  # older ones are never picked again
    assert lagged.pick(12, rng) == "v8"
    assert lagged.snapshots() == [8]


def test_mirror_and_fixed():
    rng = random.Random(0)
    mirror = MirrorSampler()
    assert {mirror.pick(v, rng) for v in range(10)} == {"live"}
    assert not any(mirror.keep(v) for v in range(10)) and mirror.snapshots() == []

    scripted = FixedSampler()
    assert {scripted.pick(v, rng) for v in range(10)} == {"scripted"}
    assert not any(scripted.keep(v) for v in range(10)) and scripted.snapshots() == []
    scripted.record("scripted", [1.0, -1.0, -1.0, 1.0])
    assert scripted.metrics() == {"selfplay/pick/live_frac": 0.0, "selfplay/win_rate/vs_scripted": 0.5}

    frozen = FixedSampler(opponent="v10")
    assert [v for v in range(30) if frozen.keep(v)] == [10] and frozen.snapshots() == [10]
    assert frozen.pick(3, rng) == "live"  # v10 does not exist yet
    frozen.add(10)
    assert frozen.pick(30, rng) == "v10"
    frozen.drop(10)
    assert frozen.pick(31, rng) == "live"


def test_pool_keeps_every_nth_version_and_caps_its_size():
    pool = PoolSampler(every=3, size=3)
    assert [v for v in range(13) if pool.keep(v)] == [0, 3, 6, 9, 12]
    assert pool.pick(0, random.Random(0)) == "live"  # empty pool
    for v in range(13):
        pool.add(v)  # those it does not keep are ignored
    assert pool.snapshots() == [6, 9, 12]  # the oldest left
    assert pool.metrics()["selfplay/pool_size"] == 3.0
    assert set(pool.distribution()) == {"live", "v6", "v9", "v12"}
    pool.drop(9)
    assert pool.snapshots() == [6, 12]


def test_pool_metrics_count_recent_picks():
    pool = PoolSampler(every=1, live_prob=0.5, window=100)
    pool.add(1)
    rng = random.Random(3)
    picks = [pool.pick(1, rng) for _ in range(1000)]
    assert pool.metrics()["selfplay/pick/live_frac"] == picks[-100:].count("live") / 100


BAD = [
    ("pool", {"rule": "greedy"}, "rule must be one of 'pfsp', 'uniform', got 'greedy'"),
    ("pool", {"pfsp_weighting": "linear"}, "pfsp_weighting must be one of 'variance', 'hard', got 'linear'"),
    ("pool", {"rating": "elo"}, "rating must be one of 'openskill', got 'elo'"),
    ("pool", {"live_prob": 1.5}, "live_prob must be a number in [0, 1], got 1.5"),
    ("pool", {"size": 0}, "size must be an integer >= 1, got 0"),
    ("pool", {"every": 0}, "every must be an integer >= 1, got 0"),
    ("pool", {"rule": "uniform", "pfsp_weighting": "hard"}, "pfsp_weighting acts only with rule = 'pfsp'"),
    ("pool", {"evry": 3}, "did you mean 'every'"),
    ("pool", {"every": "3"}, "Expected `int`, got `str`"),
    ("lagged", {"k": 0}, "k must be an integer >= 1, got 0"),
    ("fixed", {"opponent": "live"}, "use the opponent sampler 'mirror'"),
    ("fixed", {"opponent": "v-3"}, "opponent must be 'scripted' or 'v<version>' (e.g. 'v12'), got 'v-3'"),
    ("mirror", {"window": 0}, "window must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize(("name", "options", "message"), BAD, ids=[f"{n}-{sorted(o)}" for n, o, _ in BAD])
def test_bad_options_are_refused_with_what_was_wrong(name, options, message):
    with pytest.raises(ConfigError) as e:
        registry.build("opponent", name, options, field="selfplay.opponent")
    assert message in str(e.value)
    assert "selfplay.opponent." in str(e.value)


def test_a_malformed_opponent_name_is_refused():
    with pytest.raises(ValueError, match="none of 'live', 'scripted', 'v<version>'"):
        PoolSampler().record("v07", [1.0])


def test_plugins_are_found_by_name():
    assert {"mirror", "lagged", "pool", "fixed"} <= set(registry.names("opponent"))
    pool = registry.build("opponent", "pool", {"every": 3})
    assert isinstance(pool, PoolSampler) and pool.every == 3 and pool.keep(3) and not pool.keep(5)
    assert isinstance(registry.build("opponent", "lagged", {"k": 2}), LaggedSampler)
    assert isinstance(registry.build("opponent", "mirror", {}), MirrorSampler)
    assert registry.build("opponent", "fixed", {"opponent": "v4"}).snapshots() == [4]
