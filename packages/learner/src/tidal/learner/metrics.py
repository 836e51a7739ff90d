"""A step's metrics as the learner reports them: the trainer's, its timing, the run's counters, the lag of
every trained token and the rewards (per task when there are several)."""

from __future__ import annotations

import numpy as np

from tidal.core.protocol import NO_VERSION, Trajectory


def step_metrics(metrics: dict[str, float], timing: dict[str, float], ready_to_step: float | None,
                 trajectories: list[Trajectory], version: int, samples_total: int) -> tuple[dict[str, float], np.ndarray]:
    """`metrics` completed (a copy) and the lag of every sampled token of this rank's share (observation
    tokens of multi-turn samples have NO_VERSION: no lag), against `version`, the one the step made."""
    versions = [t.versions.numpy() for t in trajectories]
    lags = np.concatenate([version - 1 - v[v > NO_VERSION] for v in versions]) if versions else np.zeros(0)
    out = {
        **metrics,
        **timing,
        "train/version": float(version),
        "train/samples_total": float(samples_total),
        "staleness/lag_mean": float(lags.mean()) if len(lags) else 0.0,
        # the tail, which publishing every L steps (learner.weights.every) makes up to L - 1 by design
        "staleness/lag_p90": float(np.percentile(lags, 90)) if len(lags) else 0.0,
        "staleness/lag_max": float(lags.max()) if len(lags) else 0.0,
        "reward/mean": float(np.mean([t.reward for t in trajectories])) if trajectories else 0.0,
    }
    out.update(kv_lag_metrics(trajectories, version))
    if ready_to_step is not None:
        out["train/ready_to_step_ms"] = 1e3 * max(0.0, ready_to_step)
    by_task: dict[str, list[float]] = {}
    for t in trajectories:
        by_task.setdefault(t.task, []).append(float(t.reward))
    if len(by_task) > 1:
        out.update({f"reward/{task}": float(np.mean(r)) for task, r in by_task.items()})
    out.update(group_signal(trajectories))
    return out, lags


def group_signal(trajectories: list[Trajectory]) -> dict[str, float]:
    """How many of the batch's groups can teach a group-relative estimator anything: the share of groups (of
    two samples or more) whose rewards are all equal (`signal/zero_variance_frac`), all 0
    (`signal/all_zero_frac`) and all at the batch's highest reward when that is above 0
    (`signal/all_max_frac`); per task too (`signal/<task>/...`) when the batch holds several."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    best = max((float(t.reward) for t in trajectories), default=0.0)
    counts: dict[str, list[int]] = {}  # task -> [groups, zero variance, all zero, all max]
    for members in groups.values():
        if len(members) < 2:
            continue
        rewards = [float(t.reward) for t in members]
        flat = max(rewards) - min(rewards) <= 1e-9
        row = [1, int(flat), int(flat and rewards[0] == 0.0), int(flat and best > 0 and rewards[0] >= best - 1e-9)]
        for key in ("", members[0].task):
            c = counts.setdefault(key, [0, 0, 0, 0])
            for i, v in enumerate(row):
                c[i] += v
    out: dict[str, float] = {}
    for key, (n, n_flat, zero, top) in counts.items():
        if key and len(counts) <= 2:  # one task: its numbers are the batch's
            continue
        prefix = f"signal/{key}/" if key else "signal/"
        out.update({f"{prefix}groups": float(n), f"{prefix}zero_variance_frac": n_flat / n,
                    f"{prefix}all_zero_frac": zero / n, f"{prefix}all_max_frac": top / n})
    return out


def kv_lag_metrics(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    """The lag of the KV cache each sampled token attended to (its `kv_versions` entry, against `version` as
    `lag_mean`), and the share of those tokens whose KV is older than the version that sampled them (partial
    mode "continue" across an update). Only trajectories whose producer recorded kv_versions count; none
    such: no metrics, rather than zeros that would read as fresh KV."""
    kv, sampler = [], []
    for t in trajectories:
        if t.kv_versions is None:
            continue
        v, k = t.versions.numpy(), t.kv_versions.numpy()
        sampled = v > NO_VERSION
        kv.append(k[sampled])
        sampler.append(v[sampled])
    if not kv:
        return {}
    k_all, v_all = np.concatenate(kv), np.concatenate(sampler)
    if not len(k_all):
        return {}
    lags = version - 1 - k_all
    return {
        "staleness/kv_lag_mean": float(lags.mean()),
        "staleness/kv_lag_max": float(lags.max()),
        "staleness/kv_older_than_sampler_frac": float((k_all < v_all).mean()),
    }
