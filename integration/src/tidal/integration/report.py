"""`tidal report RUN_DIR`: a PNG of a run and a summary.json, from its metrics.jsonl.

Panels: training reward and held-out accuracy against wall-clock and against samples trained; the lag
histogram of trained tokens (policy versions between generation and training); mismatch KL between
the sampler's logprobs and the learner's recomputation, per version. A run with multi-turn domains
adds a row: tool calls per episode and the tool-error rate, turns per episode, and what episodes cost
(splits, truncations, drops), each from the rollout workers' counters, per metrics window.

A self-play run (`selfplay.opponent`) adds a row from the controller's opponent sampler: win-rates over
time (held-out games against the scripted player, i.e. eval/accuracy, and the training games against the
pool's snapshots and against itself), the pool's size, and each opponent's rating (OpenSkill mu; the live
policy's and every snapshot's while it is in the pool).

The health row: throughput over time (samples trained per second by the learner, samples generated per
second by the workers), buffer depth and the gate's samples in flight over time, and the run's events.
Events are metrics rows with a key `event/KIND` = 1 (restart: the driver restarted a role, its name in
`event/restart/ROLE`; stall: no new version for too long; drop_rate: more
training groups dropped than `launch.max_drop_rate`; resume: `tidal run --resume` continued the run);
every plot over wall-clock time marks them with a vertical line (restart red dashed, stall black,
resume green).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from tidal.integration.monitor import read_metrics
from tidal.integration.samples import summary as samples_summary


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
        "signal": _signal_summary(learner),
        # evaluations that scored no problem: no accuracy, listed apart (never a 0.0 beside the real ones)
        "eval_unscored": [int(r["scalars"]["eval/version"]) for r in rows
                          if r["source"] == "controller" and r["scalars"].get("eval/unscored")],
    }
    if out["eval"]:
        out["eval_start"] = out["eval"][0]["accuracy"]
        out["eval_end"] = out["eval"][-1]["accuracy"]
        out["eval_best"] = max(e["accuracy"] for e in out["eval"])
    return out


def _signal_summary(learner: list[dict]) -> dict[str, float]:
    """What the run could learn from (tidal.integration.signal_watch): the share of trained samples with a
    nonzero advantage over the run and over its last 10 steps, and of groups whose rewards were all equal."""
    rows = [r["scalars"] for r in learner if "signal/nonzero_adv_frac" in r["scalars"]]
    if not rows:
        return {}
    n = np.array([r.get("train/sequences", 0.0) for r in rows])
    frac = np.array([r["signal/nonzero_adv_frac"] for r in rows])
    zv = np.array([r.get("signal/zero_variance_frac", 0.0) for r in rows])
    return {"samples_with_signal_frac": float((frac * n).sum() / n.sum()) if n.sum() else 0.0,
            "samples_with_signal_frac_last10": float(frac[-10:].mean()),
            "zero_variance_groups_frac": float(zv.mean()), "zero_variance_groups_frac_last10": float(zv[-10:].mean()),
            "all_zero_groups_frac": float(np.mean([r.get("signal/all_zero_frac", 0.0) for r in rows])),
            "all_max_groups_frac": float(np.mean([r.get("signal/all_max_frac", 0.0) for r in rows]))}


EPISODE_COUNTERS = ("episodes", "finished_turns", "finished_tool_calls", "finished_tool_errors", "splits",
                    "truncated", "failed")


def episode_rates(rows: list[dict]) -> dict[str, list[float]]:
    """Per-window rates of the rollout workers' episode counters (summed over workers): {"minutes",
    "tool_calls_per_episode", "tool_error_rate", "turns_per_episode", "splits", "truncated", "failed"};
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
                                                   "turns_per_episode", "splits", "truncated", "failed")}
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
        out["failed"].append(d["failed"])
    return out if out["minutes"] else {}


def _plot_episodes(ax, e: dict[str, list[float]]) -> None:
    t = e["minutes"]
    ax[0].plot(t, e["tool_calls_per_episode"], lw=1, color="tab:purple", label="tool calls / episode")
    ax[0].plot(t, e["tool_error_rate"], lw=1, color="tab:red", label="tool-error rate")
    ax[0].set(title="tools (training episodes)", xlabel="wall-clock (min)")
    ax[0].legend()
    ax[1].plot(t, e["turns_per_episode"], lw=1, color="tab:brown")
    ax[1].set(title="turns per episode", xlabel="wall-clock (min)", ylabel="turns")
    for key, color in (("splits", "tab:gray"), ("truncated", "tab:olive"), ("failed", "tab:red")):
        ax[2].plot(t, e[key], lw=1, color=color, label=key)
    ax[2].set(title="episodes split / truncated / failed (per window)", xlabel="wall-clock (min)", ylabel="count")
    ax[2].legend()


EVENT_STYLE = {"restart": ("tab:red", "--"), "stall": ("black", "-"), "resume": ("tab:green", "-"),
               "drop_rate": ("tab:orange", ":")}


def selfplay_series(rows: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """The controller's `selfplay/*` scalars over wall-clock minutes, by key ({} for a run without)."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows:
        if r["source"] != "controller":
            continue
        for k, v in r["scalars"].items():
            if k.startswith("selfplay/"):
                t, y = out.setdefault(k, ([], []))
                t.append(r["elapsed"] / 60)
                y.append(v)
    return out


def _plot_selfplay(ax, sp: dict[str, tuple[list[float], list[float]]], evals: list[dict]) -> None:
    if evals:
        ax[0].plot([r["elapsed"] / 60 for r in evals], [100 * r["scalars"]["eval/accuracy"] for r in evals], "o-",
                   color="tab:green", label="held-out vs the eval opponent")
    for key, color in (("selfplay/win_rate/vs_pool", "tab:blue"), ("selfplay/win_rate/vs_live", "tab:gray")):
        if key in sp:
            ax[0].plot(sp[key][0], [100 * v for v in sp[key][1]], lw=1, color=color,
                       label=f"training games {key.rsplit('/', 1)[1].replace('_', ' ')}")
    ax[0].set(title="win-rate", xlabel="wall-clock (min)", ylabel="games won (%)", ylim=(0, 100))
    ax[0].legend(fontsize=8)
    if "selfplay/pool_size" in sp:
        ax[1].plot(*sp["selfplay/pool_size"], lw=1, color="tab:purple")
    ax[1].set(title="opponent pool size", xlabel="wall-clock (min)", ylabel="snapshots")
    ratings = sorted((k for k in sp if k.startswith("selfplay/rating/")),
                     key=lambda k: (k != "selfplay/rating/live", int(k.rsplit("/v", 1)[-1]) if "/v" in k else 0))
    end = max((t[-1] for t, _ in sp.values()), default=0.0)
    for k in ratings:  # every snapshot's line while it was in the pool; the legend names the pool at the end
        live = k == "selfplay/rating/live"
        last = live or sp[k][0][-1] >= end
        ax[2].plot(*sp[k], lw=2 if live else 0.8, color="black" if live else None, alpha=1.0 if last else 0.35,
                   label=k.rsplit("/", 1)[1] if last else None)
    ax[2].set(title="ratings (OpenSkill mu; legend: the final pool)", xlabel="wall-clock (min)", ylabel="mu")
    if ratings:
        ax[2].legend(fontsize=7, ncol=2)


def events(rows: list[dict]) -> list[tuple[float, str, str]]:
    """(minutes into the run, kind, detail) of each event row: restart (detail: the role), stall, resume."""
    out = []
    for r in rows:
        for k in r["scalars"]:
            if k.startswith("event/") and k.count("/") == 1:
                kind = k.split("/", 1)[1]
                detail = next((x.split("/", 2)[2] for x in r["scalars"] if x.startswith(f"event/{kind}/")), "")
                out.append((r["elapsed"] / 60, kind, detail))
    return out


def throughput(rows: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Over wall-clock minutes: "trained" (samples/s, the learner's cumulative count differenced) and
    "generated" (samples/s, the workers' own rates summed per controller report)."""
    # rates between the learner's own timestamps ("time"), plotted where the driver wrote them ("elapsed")
    learner = [(r["time"], r["elapsed"], r["scalars"]["train/samples_total"]) for r in rows
               if r["source"] == "learner-0" and "train/samples_total" in r["scalars"]]
    trained_t, trained = [], []
    for (t0, _, s0), (t1, e1, s1) in itertools.pairwise(learner):
        if t1 > t0 and s1 >= s0:  # a restarted learner's count can go back: skip that step
            trained_t.append(e1 / 60)
            trained.append((s1 - s0) / (t1 - t0))
    latest: dict[str, float] = {}
    gen_t, gen = [], []
    for r in rows:
        if r["source"].startswith("rollout") and "rollout/samples_per_s" in r["scalars"]:
            latest[r["source"]] = r["scalars"]["rollout/samples_per_s"]
        elif r["source"] == "controller" and "controller/gate_in_flight" in r["scalars"] and latest:
            gen_t.append(r["elapsed"] / 60)
            gen.append(sum(latest.values()))
    return {"trained": (trained_t, trained), "generated": (gen_t, gen)}


def _plot_health(ax, rows: list[dict], evs: list[tuple[float, str, str]]) -> None:
    tp = throughput(rows)
    ax[0].plot(*tp["trained"], lw=1, color="tab:blue", label="trained (learner)")
    ax[0].plot(*tp["generated"], lw=1, color="tab:orange", label="generated (workers)")
    ax[0].set(title="throughput", xlabel="wall-clock (min)", ylabel="samples / s")
    ax[0].legend()
    depth = [(r["elapsed"] / 60, r["scalars"]["depth/ready_samples"]) for r in rows
             if r["source"].startswith("buffer") and "depth/ready_samples" in r["scalars"]]
    gate = [(r["elapsed"] / 60, r["scalars"]["controller/gate_in_flight"],
             r["scalars"].get("controller/gate_capacity", np.nan)) for r in rows
            if r["source"] == "controller" and "controller/gate_in_flight" in r["scalars"]]
    if depth:
        ax[1].plot(*zip(*depth, strict=True), lw=1, color="tab:purple", label="buffer: ready samples")
    ax[1].set(title="buffer depth", xlabel="wall-clock (min)", ylabel="samples")
    if gate:
        g = ax[1].twinx()
        g.plot([x[0] for x in gate], [x[1] for x in gate], lw=1, color="tab:gray", label="gate: samples in flight")
        g.plot([x[0] for x in gate], [x[2] for x in gate], lw=1, ls=":", color="tab:gray", label="gate: room left")
        g.set(ylabel="samples")
        g.legend(loc="center right", fontsize=8)
    if depth:
        ax[1].legend(loc="upper left")
    kinds = ["restart", "stall", "resume"]
    ax[2].set(title="events (restarts, stalls, resumes)", xlabel="wall-clock (min)", yticks=range(len(kinds)),
              yticklabels=kinds, ylim=(-0.5, len(kinds) - 0.5))
    for t, kind, detail in evs:
        y = kinds.index(kind) if kind in kinds else len(kinds) - 1
        color = EVENT_STYLE.get(kind, ("tab:gray", "-"))[0]
        ax[2].plot([t], [y], "o", color=color)
        if detail:
            ax[2].annotate(detail, (t, y), textcoords="offset points", xytext=(3, 4), fontsize=8)
    if rows:  # the whole run, as the other plots over wall-clock time
        ax[2].set_xlim(0, max(r["elapsed"] for r in rows) / 60)
    if not evs:
        ax[2].text(0.5, 0.5, "no restart, stall or resume", transform=ax[2].transAxes, ha="center", color="tab:gray")


def _plot_training(ax, learner: list[dict], evals: list[dict]) -> None:
    """The first two rows: training reward and held-out accuracy over time and samples, the lag of trained
    tokens and the mismatch KL."""
    samples = np.cumsum([r["scalars"].get("train/sequences", 0.0) for r in learner])
    version_samples = {int(r["scalars"].get("train/version", 0)): s for r, s in zip(learner, samples, strict=True)}
    version_samples[0] = 0.0
    t = [r["elapsed"] / 60 for r in learner]
    reward = [r["scalars"].get("reward/mean", np.nan) for r in learner]
    et = [r["elapsed"] / 60 for r in evals]
    acc = [100 * r["scalars"]["eval/accuracy"] for r in evals]
    es = [version_samples.get(int(r["scalars"]["eval/version"]), np.nan) for r in evals]
    ax[0, 0].plot(t, reward, lw=1, color="tab:blue")
    ax[0, 0].set(title="training reward (mean per step)", xlabel="wall-clock (min)", ylabel="reward")
    signal = [100 * r["scalars"].get("signal/nonzero_adv_frac", np.nan) for r in learner]
    if any(np.isfinite(signal)):  # what the steps could learn from: 0 % = every group's rewards equal
        twin = ax[0, 0].twinx()
        twin.plot(t, signal, lw=0.8, ls="--", color="tab:gray")
        twin.set(ylabel="samples with signal (%)", ylim=(0, 105))
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


def _mark_events(ax, evs: list, episodes: dict, selfplay: bool = False) -> None:
    """A vertical line on every plot over wall-clock time where the run restarted a role, stalled or was
    resumed."""
    timed = [ax[0, 0], ax[0, 1], ax[-1, 0], ax[-1, 1], ax[-1, 2]] + (list(ax[2]) if episodes else []) \
        + (list(ax[-2]) if selfplay else [])
    for at, kind, _ in evs:
        color, style = EVENT_STYLE.get(kind, ("tab:gray", "-"))
        for a in timed:
            a.axvline(at, color=color, ls=style, lw=0.8, alpha=0.6)


def _report_summary(run_dir: Path, rows: list[dict], evs: list, episodes: dict) -> dict:
    summary = summarize(rows)
    summary["events"] = {k: sum(1 for e in evs if e[1] == k) for k in sorted({e[1] for e in evs})}
    summary["samples"] = samples_summary(run_dir)  # where the transcripts are (`tidal samples RUN_DIR`)
    if episodes:
        # the last quarter of the run's windows (one window alone is a handful of episodes)
        tail = max(1, len(episodes["minutes"]) // 4)
        summary["episodes"] = {k: float(np.mean(v[-tail:])) for k, v in episodes.items() if k != "minutes"}
    return summary


def _report_title(run_dir: Path, summary: dict) -> str:
    title = f"{run_dir.name}: {summary['versions']} versions, {summary['samples_trained']:.0f} samples, " \
            f"{summary['wall_s'] / 60:.1f} min"
    if "eval_start" in summary:
        title += f"; held-out accuracy {100 * summary['eval_start']:.1f}% -> {100 * summary['eval_end']:.1f}%"
    if summary["eval_unscored"]:
        title += f"; eval unscored at version {', '.join(map(str, summary['eval_unscored']))}"
    return title


def report(run_dir: str | Path) -> Path:
    """Write <run_dir>/report.png and <run_dir>/summary.json; returns the PNG's path."""
    # heavy: matplotlib; only drawing the PNG needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend: a display-less one

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    learner = [r for r in rows if r["source"] == "learner-0"]
    evals = [r for r in rows if r["source"] == "controller" and "eval/accuracy" in r["scalars"]]
    episodes = episode_rates(rows)
    sp = selfplay_series(rows)
    evs = events(rows)
    nrows = 3 + bool(episodes) + bool(sp)
    fig, ax = plt.subplots(nrows, 3, figsize=(15, 4.2 * nrows + 0.5))
    _plot_training(ax, learner, evals)
    if episodes:
        _plot_episodes(ax[2], episodes)
    if sp:
        _plot_selfplay(ax[-2], sp, evals)
    _plot_health(ax[-1], rows, evs)
    _mark_events(ax, evs, episodes, bool(sp))
    for a in ax.flat:
        a.grid(alpha=0.3)
    summary = _report_summary(run_dir, rows, evs, episodes)
    if sp:  # the sampler's last word: pool, ratings, win-rates
        end = max(t[-1] for t, _ in sp.values())  # the final row's keys: the pool as it ended, not every snapshot it held
        summary["selfplay"] = {k.removeprefix("selfplay/"): v[1][-1] for k, v in sp.items() if v[0][-1] >= end}
    fig.suptitle(_report_title(run_dir, summary))
    fig.tight_layout()
    png = run_dir / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return png
