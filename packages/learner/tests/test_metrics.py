"""The step's lag metrics: sampling lag of every sampled token, and KV lag where producers recorded it."""

from __future__ import annotations

import numpy as np

from tidal.core.arrays import Array
from tidal.core.protocol import NO_VERSION, Trajectory
from tidal.learner.metrics import step_metrics


def _traj(i: int, versions: list[int], kv: list[int] | None) -> Trajectory:
    def arr(x: list, dt: type) -> Array:
        return Array.from_numpy(np.asarray(x, dt))

    n = len(versions)
    return Trajectory(id=f"s{i}", group_id="g", sample_index=i, task="toy", prompt_ids=arr([1], np.int32),
                      completion_ids=arr([2] * n, np.int32), logprobs=arr([-1.0] * n, np.float32),
                      versions=arr(versions, np.int32), reward=0.0, finish_reason="stop",
                      kv_versions=None if kv is None else arr(kv, np.int32))


def test_kv_lag_is_reported_over_the_sampled_tokens_of_trajectories_that_carry_it():
    trajs = [
        _traj(0, [3, 4, NO_VERSION, 4], [3, 3, NO_VERSION, 3]),  # continue mode: version 4 over version 3's KV
        _traj(1, [4, 4], [4, 4]),
        _traj(2, [2, 2], None),  # a producer that did not record it: not counted
    ]
    out, lags = step_metrics({}, {}, None, trajs, version=6, samples_total=3)
    assert sorted(lags.tolist()) == [1, 1, 1, 1, 2, 3, 3]
    kv_lags = [6 - 1 - k for k in (3, 3, 3, 4, 4)]
    assert out["staleness/kv_lag_mean"] == np.mean(kv_lags) and out["staleness/kv_lag_max"] == 2.0
    assert out["staleness/kv_older_than_sampler_frac"] == 2 / 5


def test_no_kv_metrics_when_no_trajectory_carries_kv_versions():
    out, _ = step_metrics({}, {}, None, [_traj(0, [1, 2], None)], version=3, samples_total=1)
    assert not any(k.startswith("staleness/kv_") for k in out)
