"""`tidal report RUN_DIR`: a PNG of a run and a summary.json, from its metrics.jsonl.

Panels: training reward and held-out accuracy against wall-clock and against samples trained; the lag
histogram of trained tokens (policy versions between generation and training); mismatch KL between
the sampler's logprobs and the learner's recomputation, per version. A run with multi-turn domains
adds a row: tool calls per episode and the tool-error rate, turns per episode, and what episodes cost
(splits, truncations, drops), each from the rollout workers' counters, per metrics window.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tidal.integration.monitor import read_metrics


def summarize(rows: list[dict]) -> dict:
    learner = [r for r in rows if r["source"] == "learner-0"]
    evals = [r for r in rows if r["source"] == "controller" and "eval/accuracy" in r["scalars"]]
    samples = np.cumsum([r["scalars"].get("train/sequences", 0.0) for r in learner]) if learner else np.zeros(0)
    lags = np.concatenate([np.asarray(r["histograms"]["lag"]) for r in learner if "lag" in r.get("histograms", {})]
                          or [np.zeros(0)])
    out: dict[str, Any] = {
        "versions": int(learner[-1]["scalars"].get("train/version", 0)) if learner else 0,
        "samples_trained": float(samples[-1]) if len(samples) else 0.0,
        "wall_s": float(rows[-1]["elapsed"]) if rows else 0.0,
        "eval": [{"version": int(r["scalars"]["eval/version"]), "elapsed_s": r["elapsed"],
                  "accuracy": r["scalars"]["eval/accuracy"],
                  **{k: v for k, v in r["scalars"].items() if k.endswith("/accuracy") and k != "eval/accuracy"}}
                 for r in evals],
        "lag_mean": float(lags.mean()) if lags.size else 0.0,
        "lag_max": int(lags.max()) if lags.size else 0,
        "reward_last": float(learner[-1]["scalars"].get("reward/mean", 0.0)) if learner else 0.0,
    }
    if out["eval"]:
        out["eval_start"] = out["eval"][0]["accuracy"]
        out["eval_end"] = out["eval"][-1]["accuracy"]
        out["eval_best"] = max(e["accuracy"] for e in out["eval"])
    return out


EPISODE_COUNTERS = ("episodes", "finished_turns", "finished_tool_calls", "finished_tool_errors", "splits",
                    "truncated", "episodes_dropped")


def episode_rates(rows: list[dict]) -> dict[str, list[float]]:
    """Per-window rates of the rollout workers' episode counters (summed over workers): {"minutes",
    "tool_calls_per_episode", "tool_error_rate", "turns_per_episode", "splits", "truncated", "dropped"};
    {} when the run has no multi-turn domain."""
    last: dict[str, dict[str, float]] = {}
    points: list[tuple[float, dict[str, float]]] = []
    for r in rows:
        sc = r["scalars"]
        if not r["source"].startswith("rollout") or "rollout/episodes/episodes" not in sc:
            continue
        now = {k: float(sc.get(f"rollout/episodes/{k}", 0.0)) for k in EPISODE_COUNTERS}
        before = last.get(r["source"], dict.fromkeys(EPISODE_COUNTERS, 0.0))
        last[r["source"]] = now
        points.append((r["elapsed"], {k: now[k] - before[k] for k in EPISODE_COUNTERS}))
    if not points:
        return {}
    points.sort(key=lambda p: p[0])
    per = max(1, len(last))  # one window = one report of every worker
    out: dict[str, list[float]] = {k: [] for k in ("minutes", "tool_calls_per_episode", "tool_error_rate",
                                                   "turns_per_episode", "splits", "truncated", "dropped")}
    for i in range(0, len(points), per):
        chunk = points[i:i + per]
        d = {k: sum(p[1][k] for p in chunk) for k in EPISODE_COUNTERS}
        if d["episodes"] <= 0:
            continue
        out["minutes"].append(chunk[-1][0] / 60)
        # of the episodes that ended in the window: their turns and calls counted together
        out["tool_calls_per_episode"].append(d["finished_tool_calls"] / d["episodes"])
        out["tool_error_rate"].append(d["finished_tool_errors"] / d["finished_tool_calls"]
                                      if d["finished_tool_calls"] else 0.0)
        out["turns_per_episode"].append(d["finished_turns"] / d["episodes"])
        out["splits"].append(d["splits"])
        out["truncated"].append(d["truncated"])
        out["dropped"].append(d["episodes_dropped"])
    return out if out["minutes"] else {}


def _plot_episodes(ax, e: dict[str, list[float]]) -> None:
    t = e["minutes"]
    ax[0].plot(t, e["tool_calls_per_episode"], lw=1, color="tab:purple", label="tool calls / episode")
    ax[0].plot(t, e["tool_error_rate"], lw=1, color="tab:red", label="tool-error rate")
    ax[0].set(title="tools (training episodes)", xlabel="wall-clock (min)")
    ax[0].legend()
    ax[1].plot(t, e["turns_per_episode"], lw=1, color="tab:brown")
    ax[1].set(title="turns per episode", xlabel="wall-clock (min)", ylabel="turns")
    for key, color in (("splits", "tab:gray"), ("truncated", "tab:olive"), ("dropped", "tab:red")):
        ax[2].plot(t, e[key], lw=1, color=color, label=key)
    ax[2].set(title="episodes split / truncated / dropped (per window)", xlabel="wall-clock (min)", ylabel="count")
    ax[2].legend()


def report(run_dir: str | Path) -> Path:
    """Write <run_dir>/report.png and <run_dir>/summary.json; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    learner = [r for r in rows if r["source"] == "learner-0"]
    evals = [r for r in rows if r["source"] == "controller" and "eval/accuracy" in r["scalars"]]
    samples = np.cumsum([r["scalars"].get("train/sequences", 0.0) for r in learner])
    version_samples = {int(r["scalars"].get("train/version", 0)): s for r, s in zip(learner, samples, strict=True)}
    version_samples[0] = 0.0

    episodes = episode_rates(rows)
    fig, ax = plt.subplots(3 if episodes else 2, 3, figsize=(15, 12.5 if episodes else 8.5))
    t = [r["elapsed"] / 60 for r in learner]
    reward = [r["scalars"].get("reward/mean", np.nan) for r in learner]
    et = [r["elapsed"] / 60 for r in evals]
    acc = [100 * r["scalars"]["eval/accuracy"] for r in evals]
    es = [version_samples.get(int(r["scalars"]["eval/version"]), np.nan) for r in evals]
    ax[0, 0].plot(t, reward, lw=1, color="tab:blue")
    ax[0, 0].set(title="training reward (mean per step)", xlabel="wall-clock (min)", ylabel="reward")
    ax[1, 0].plot(samples, reward, lw=1, color="tab:blue")
    ax[1, 0].set(title="training reward", xlabel="samples trained", ylabel="reward")
    ax[0, 1].plot(et, acc, "o-", color="tab:green")
    ax[0, 1].set(title="held-out accuracy", xlabel="wall-clock (min)", ylabel="accuracy (%)", ylim=(0, 100))
    ax[1, 1].plot(es, acc, "o-", color="tab:green")
    ax[1, 1].set(title="held-out accuracy", xlabel="samples trained", ylabel="accuracy (%)", ylim=(0, 100))
    lags = [np.asarray(r["histograms"]["lag"]) for r in learner if "lag" in r.get("histograms", {})]
    lag = np.concatenate(lags) if lags else np.zeros(0)
    if lag.size:
        ax[0, 2].hist(lag, bins=np.arange(lag.max() + 2) - 0.5, color="tab:orange")
    ax[0, 2].set(title="lag of trained tokens", xlabel="versions behind the learner", ylabel="tokens")
    versions = [r["scalars"].get("train/version", 0) for r in learner]
    ax[1, 2].plot(versions, [r["scalars"].get("staleness/mismatch_kl", np.nan) for r in learner], lw=1, color="tab:red")
    ax[1, 2].set(title="mismatch KL (sampler vs learner)", xlabel="policy version", ylabel="KL")
    if episodes:
        _plot_episodes(ax[2], episodes)
    for a in ax.flat:
        a.grid(alpha=0.3)
    summary = summarize(rows)
    if episodes:
        # the last quarter of the run's windows (one window alone is a handful of episodes)
        tail = max(1, len(episodes["minutes"]) // 4)
        summary["episodes"] = {k: float(np.mean(v[-tail:])) for k, v in episodes.items() if k != "minutes"}
    title = f"{run_dir.name}: {summary['versions']} versions, {summary['samples_trained']:.0f} samples, " \
            f"{summary['wall_s'] / 60:.1f} min"
    if "eval_start" in summary:
        title += f"; held-out accuracy {100 * summary['eval_start']:.1f}% -> {100 * summary['eval_end']:.1f}%"
    fig.suptitle(title)
    fig.tight_layout()
    png = run_dir / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return png
