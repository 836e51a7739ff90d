"""The controller's side of self-play (tidal.integration.selfplay): snapshots found in the run's folder join
the opponent sampler, the ones it no longer wants are deleted, the live seat's results rate the opponents,
and the sampler's state (pool, ratings) survives a restart of the driver through <run_dir>/selfplay.json."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from tidal.core.config import PluginRef
from tidal.core.episodes import snapshot_name
from tidal.core.errors import ConfigError
from tidal.integration import selfplay
from tidal.integration.selfplay import STATE, SelfPlay
from tidal.rollout.envs.nim import Nim

POOL = PluginRef(name="pool", options={"every": 5, "size": 2, "live_prob": 0.0})


def _domains():
    return [SimpleNamespace(name="nim", env=Nim()), SimpleNamespace(name="arith", env=SimpleNamespace(roles=("agent",)))]


def _snapshot(run_dir, version: int) -> None:
    (run_dir / "snapshots").mkdir(exist_ok=True)
    (run_dir / "snapshots" / snapshot_name(version)).write_bytes(b"weights")  # the controller only lists names


def test_snapshots_join_the_pool_and_the_unwanted_are_deleted(tmp_path, monkeypatch):
    sp = SelfPlay(POOL, "scripted", tmp_path, _domains(), seed=0)
    assert sp.games == {"nim": ("first", "second")}
    assert sp.opponent("arith", 0) is None and sp.eval_for("arith") is None and sp.eval_for("nim") == "scripted"
    assert sp.opponent("nim", 0) == "live"  # an empty pool
    for v in (0, 5, 10):
        _snapshot(tmp_path, v)
    sp.scan()
    assert sp.sampler.snapshots() == [5, 10]  # size 2: the oldest left the pool...
    files = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert files == [snapshot_name(0), snapshot_name(5), snapshot_name(10)]  # its file stays a while (groups in flight)
    monkeypatch.setattr(selfplay, "DELETE_AFTER_S", 0.0)
    sp.scan()
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == [snapshot_name(5), snapshot_name(10)]  # ...then goes
    assert {sp.opponent("nim", 12) for _ in range(50)} == {"v5", "v10"}


def test_a_restarted_driver_keeps_the_pool_and_its_ratings(tmp_path):
    sp = SelfPlay(POOL, "scripted", tmp_path, _domains(), seed=0)
    for v in (0, 5):
        _snapshot(tmp_path, v)
    sp.poll(now=0.0)
    sp.record("v5", [1.0, 1.0, 1.0, -1.0])
    sp.record("v0", [1.0] * 6)
    sp.close()
    saved = json.loads((tmp_path / STATE).read_text())
    ratings = {p["version"]: p["mu"] for p in saved["pool"]}
    assert ratings[0] < ratings[5] < saved["live"]["mu"]  # the live policy beat both, v0 the most
    again = SelfPlay(POOL, "scripted", tmp_path, _domains(), seed=0)  # the resumed run's controller
    assert again.sampler.state() == sp.sampler.state() and again.metrics() == sp.metrics()
    rng_a, rng_b = random.Random(3), random.Random(3)
    assert [again.sampler.pick(20, rng_a) for _ in range(20)] == [sp.sampler.pick(20, rng_b) for _ in range(20)]
    _snapshot(tmp_path, 10)  # written while the driver was away: found on the next scan
    again.scan()
    assert again.sampler.snapshots() == [5, 10]


def test_a_state_of_another_sampler_is_refused(tmp_path):
    (tmp_path / STATE).write_text(json.dumps({"sampler": "mirror", "picks": [], "results": []}))
    with pytest.raises(ConfigError, match="selfplay.json: the saved opponent state is of sampler 'mirror'") as e:
        SelfPlay(POOL, "scripted", tmp_path, _domains(), seed=0)
    assert e.value.field == "selfplay.opponent"
