"""What a failed episode does to its group (`EpisodesConfig.on_error`), with the real embedded engine on the
tiny model and real episodes in this process (`LocalEpisodes`): `flaky` episodes whose `outcome()` raises
by number, and the infrastructure's own failure (`env_died`, `env_restarted`) as the pool reports it."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tidal.core.arrays import Array
from tidal.core.config import Domain, PluginRef
from tidal.core.interfaces import Task
from tidal.core.protocol import Assignment, EpisodeReply, SamplingParams, trajectory_id
from tidal.rollout.episodes.local import LocalEpisodes
from tidal.rollout.episodes.multiturn import EpisodeFailed, EpisodesConfig, MultiTurn
from tidal.rollout.episodes.renderers import PlainRenderer
from tidal.rollout.tiny import load_tokenizer

SAMPLING = SamplingParams(temperature=1.0, max_tokens=4, seed=7)
GROUP = "flaky-0000001"


@pytest.fixture(autouse=True)
def _plugins_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # envpool_plugins, for the in-process host


@pytest.fixture(scope="module")
def engine(tiny_model):
    from tidal.rollout.engines.embedded import EmbeddedEngine

    e = EmbeddedEngine(str(tiny_model), max_num_seqs=16, seed=0)
    yield e
    e.close()


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


def _start(engine, tok, fail: list[int], **cfg) -> tuple[MultiTurn, LocalEpisodes]:
    pool = LocalEpisodes([Domain(env=PluginRef(name="flaky", options={"fail": fail}))], plugins=["envpool_plugins"])
    mt = MultiTurn(EpisodesConfig(max_tokens=64, **cfg), pool, engine, tok, lambda: PlainRenderer(tok))
    a = Assignment(group_id=GROUP, prompt_ids=Array.from_numpy(np.zeros(0, np.int32)), num_samples=4, task="flaky",
                   sampling=SAMPLING, prompt="judge me")
    mt.start(a, Task(prompt="judge me", domain="flaky"))
    return mt, pool


def _handle(mt: MultiTurn, e: EpisodeFailed) -> str | None:
    what = mt.on_failure(e)
    return what if what in ("complete", "drop") else None


def _drive(mt: MultiTurn, pool, engine, inject: list[EpisodeReply] = (), timeout: float = 60) -> str:
    """Runs the group to its end as the worker does: "complete" or "drop"."""
    pending = list(inject)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replies, pending = [*pending, *pool.poll(timeout=0)], []
        for reply in replies:
            try:
                if mt.on_reply(reply) is not None:
                    return "complete"
            except EpisodeFailed as e:
                if (end := _handle(mt, e)) is not None:
                    return end
        for res in engine.poll(timeout=0.01):
            try:
                mt.on_result(res)
            except EpisodeFailed as e:
                if (end := _handle(mt, e)) is not None:
                    return end
    raise AssertionError(f"the group did not end within {timeout:g} s")


def test_drop_group_is_the_default_and_counts_the_episode_by_kind(engine, tok):
    mt, pool = _start(engine, tok, fail=[1])
    assert mt.cfg.on_error == "drop_group"
    assert _drive(mt, pool, engine) == "drop"
    m = mt.metrics()
    assert m["rollout/episodes/failed"] == 1 and m["rollout/episodes/failed/verifier_error"] == 1
    assert m["rollout/episodes/retried"] == 0


def test_survivors_trains_the_finished_episodes_with_their_own_group_size(engine, tok):
    mt, pool = _start(engine, tok, fail=[1], on_error="survivors")
    assert _drive(mt, pool, engine) == "complete"
    trajs = mt.trajectories(GROUP, "rollout-0")
    assert sorted(t.sample_index for t in trajs) == [0, 2, 3]
    assert all(t.group_size == 3 for t in trajs)  # the estimator's baseline is over the survivors
    (why,) = mt.left_out(GROUP)  # the author's text travels with the left-out sample
    assert "episode 1 cannot be judged" in why and "flaky" in why, why


def test_survivors_below_min_survivors_drops_the_group(engine, tok):
    mt, pool = _start(engine, tok, fail=[0, 1, 2], on_error="survivors", min_survivors=2)
    assert _drive(mt, pool, engine) == "drop"
    assert mt.metrics()["rollout/episodes/failed"] >= 3 - 1  # the third failure may come after the drop


def test_retry_reruns_the_episode_under_a_new_id(engine, tok):
    mt, pool = _start(engine, tok, fail=[1], on_error="retry")
    assert _drive(mt, pool, engine) == "complete"
    ids = sorted(t.id for t in mt.trajectories(GROUP, "rollout-0"))
    assert ids == sorted([trajectory_id(GROUP, 0), f"{trajectory_id(GROUP, 1)}~r1", trajectory_id(GROUP, 2),
                          trajectory_id(GROUP, 3)])
    m = mt.metrics()
    assert m["rollout/episodes/retried"] == 1 and m["rollout/episodes/failed"] == 1


def test_retries_end_at_max_retries(engine, tok):
    mt, pool = _start(engine, tok, fail=[1, 4], on_error="retry", max_retries=1)  # the retry (number 4) fails too
    assert _drive(mt, pool, engine) == "drop"
    assert mt.metrics()["rollout/episodes/retried"] == 1


@pytest.mark.parametrize("kind", ["env_died", "env_restarted"])
def test_an_infrastructure_failure_is_retried_whatever_the_policy(engine, tok, kind):
    mt, pool = _start(engine, tok, fail=[])
    lost = EpisodeReply(episode_id=trajectory_id(GROUP, 2), seq=0, error_kind=kind,
                        error="its environment process was killed")
    assert _drive(mt, pool, engine, inject=[lost]) == "complete"
    ids = {t.id for t in mt.trajectories(GROUP, "rollout-0")}
    assert f"{trajectory_id(GROUP, 2)}~r1" in ids and len(ids) == 4
    m = mt.metrics()
    assert m["rollout/episodes/retried"] == 1 and m[f"rollout/episodes/failed/{kind}"] == 1


def test_an_infrastructure_failure_past_max_retries_drops_the_group(engine, tok):
    mt, pool = _start(engine, tok, fail=[], max_retries=0)
    lost = EpisodeReply(episode_id=trajectory_id(GROUP, 0), seq=0, error_kind="env_died", error="killed")
    assert _drive(mt, pool, engine, inject=[lost]) == "drop"
    assert mt.metrics()["rollout/episodes/retried"] == 0
