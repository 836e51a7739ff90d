"""Learning at large policy lag: the same task and budget with the learner publishing its weights only every
L steps (`learner.weights.every = L`, OAPL's "lag by design"; `max_staleness = max(2, L - 1)` so the depth
gate lets generation run that far ahead), for the default objective, OAPL and M2PO. Held-out accuracy
against samples trained, one PNG with every curve and a JSON summary.

    uv run --locked --all-packages python tools/study/lag.py                    # L = 1, 4, 16, 64 x 3 objectives
    uv run --locked --all-packages python tools/study/lag.py --lags 1,16 --objectives default,oapl   # a look

Every run is a real `tidal run` (rollout worker, buffer, learner and controller as processes) from the
demo's warm start (built once in --out, reused), with the demo's recipe (integration/recipes/arithmetic.toml)
and these objectives:
- default: the recipe's, PPO clip 0.2 / 0.28 (DAPO clip-higher) with token TIS (cap 2) and GRPO advantages;
- oapl: OAPL's squared regression on the lagged policy's sequence log-ratio, its softmax group value;
- m2po: M2PO's second-moment masking (no clip, no TIS), GRPO advantages.

The task is made harder than the demo's (see TASK): the demo's warm start fixes its carries within ~30
versions at any lag, so no objective could be told apart. Each run is bounded by --minutes (the budget in
versions is the same for all; a run stopped by the clock is reported as such, never compared).
Prints a table (held-out accuracy at each objective's last version, the gap to L = 1, mean and max lag,
wall time) and the issue's goal: at L = 16, OAPL or M2PO ends within 5 points of its L = 1 run while the
default loses more.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from tidal.core.config import PluginRef

# what each objective sets in learner.train (None: no staleness correction)
OBJECTIVES: dict[str, dict[str, Any]] = {
    "default": {},
    "oapl": {"loss": PluginRef(name="oapl"), "advantage": PluginRef(name="oapl"), "correction": None},
    "m2po": {"loss": PluginRef(name="m2po"), "advantage": PluginRef(name="grpo"), "correction": None},
}
# harder than the demo (its warm start has the carry 40 % of the time and fixes it within ~30 versions):
# a demonstrator that forgets the carry 90 % of the time, and a shorter SFT
TASK = ["sft.carry_slip=0.9", "sft.steps=600"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/study-lag", help="warm start (reused) and one run folder per curve")
    ap.add_argument("--lags", default="1,4,16,64", help="publish periods L, comma-separated")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES), help=f"of {', '.join(OBJECTIVES)}")
    ap.add_argument("--versions", type=int, default=128, help="learner steps per run (64 samples each)")
    ap.add_argument("--eval-every", type=int, default=8, help="held-out rounds every N versions (at published ones)")
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock bound per run")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a recipe override for every run (repeatable), e.g. learner.backend.options.optim.lr=3e-4")
    return ap.parse_args()


def config(out: Path, objective: str, lag: int, a: argparse.Namespace) -> Any:
    from tidal.integration.demo import demo_config

    cfg, opts = demo_config(out, [
        *TASK, f'run_dir="{out / f"{objective}-L{lag}"}"', f"budget.versions={a.versions}",
        f"budget.minutes={a.minutes}", f"eval.every={a.eval_every}", f"learner.weights.every={lag}",
        f"max_staleness={max(2, lag - 1)}", "monitor.progress=off", "monitor.tensorboard=false", *a.set])
    train = msgspec.structs.replace(cfg.learner.train, **OBJECTIVES[objective])
    return msgspec.structs.replace(cfg, learner=msgspec.structs.replace(cfg.learner, train=train)), opts


def run_one(out: Path, objective: str, lag: int, a: argparse.Namespace) -> dict[str, Any]:
    """One run; its held-out curve against samples trained, its lag and its wall time."""
    from tidal.integration.recipe import check
    from tidal.integration.run import run

    cfg, _ = config(out, objective, lag, a)
    check(cfg)
    run_dir = Path(cfg.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a run folder holds one run: its metrics.jsonl must be this one's
    t0 = time.time()
    result = run(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    learner = {int(r["step"]): r["scalars"] for r in rows if r["source"] == "learner-0"}
    curve = [{"version": v, "samples": int(learner[v]["train/samples_total"]) if v in learner else 0, "acc": acc}
             for v, acc, _ in sorted(result.eval) if v == 0 or v in learner]
    lags = [s.get("staleness/lag_mean", 0.0) for s in learner.values()]
    return {"objective": objective, "lag": lag, "status": result.status, "versions": result.versions,
            "complete": result.status == "completed" and result.versions >= a.versions, "curve": curve,
            "final_acc": curve[-1]["acc"] if curve else None, "lag_mean": sum(lags) / max(len(lags), 1),
            "lag_max": max((s.get("staleness/lag_max", 0.0) for s in learner.values()), default=0.0),
            "skipped_steps": max((s.get("train/skipped_steps_total", 0.0) for s in learner.values()), default=0.0),
            "wall_s": time.time() - t0, "run_dir": str(run_dir)}


def goal(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """At L = 16: the gap (points) of each objective's final held-out accuracy to its own L = 1 run's."""
    by = {(r["objective"], r["lag"]): r for r in runs if r["complete"]}
    gaps = {o: 100 * (by[(o, 1)]["final_acc"] - by[(o, 16)]["final_acc"])
            for o in OBJECTIVES if (o, 1) in by and (o, 16) in by}
    off = {o: g for o, g in gaps.items() if o != "default"}
    met = bool(off) and "default" in gaps and min(off.values()) <= 5.0 and gaps["default"] > min(off.values())
    return {"gap_points_at_L16": gaps, "met": met,
            "text": "at L = 16, OAPL or M2PO within 5 points of its L = 1 run, the default losing more"}


def table(runs: list[dict[str, Any]]) -> None:
    base = {r["objective"]: r["final_acc"] for r in runs if r["lag"] == 1 and r["complete"]}
    print(f"\n{'objective':<9} {'L':>3} {'final acc':>9} {'vs L=1':>7} {'lag mean':>8} {'lag max':>7} "
          f"{'skipped':>7} {'wall s':>6}  status")
    for r in runs:
        acc = r["final_acc"]
        gap = f"{100 * (acc - base[r['objective']]):+.1f}" if acc is not None and r["objective"] in base else "-"
        print(f"{r['objective']:<9} {r['lag']:>3} {'-' if acc is None else f'{100 * acc:.1f}%':>9} {gap:>7} "
              f"{r['lag_mean']:>8.1f} {r['lag_max']:>7.0f} {r['skipped_steps']:>7.0f} {r['wall_s']:>6.0f}  "
              f"{r['status']}{'' if r['complete'] else ' (not compared)'}")


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend: a display-less one

    objectives = list(dict.fromkeys(r["objective"] for r in runs))
    fig, axes = plt.subplots(1, len(objectives), figsize=(5 * len(objectives), 4), sharey=True, squeeze=False)
    for ax, objective in zip(axes[0], objectives, strict=True):
        for r in (r for r in runs if r["objective"] == objective):
            xs = [p["samples"] for p in r["curve"]]
            ax.plot(xs, [100 * p["acc"] for p in r["curve"]], marker="o", ms=3,
                    label=f"L = {r['lag']}" + ("" if r["complete"] else " (incomplete)"))
        ax.set_title(objective)
        ax.set_xlabel("samples trained")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("held-out accuracy (%)")
    fig.suptitle("publishing weights every L steps: held-out accuracy against samples trained")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    a = parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    objectives = [o.strip() for o in a.objectives.split(",") if o.strip()]
    unknown = [o for o in objectives if o not in OBJECTIVES]
    if unknown:
        sys.exit(f"--objectives: unknown {', '.join(unknown)}; choose from {', '.join(OBJECTIVES)}")
    lags = sorted({int(x) for x in a.lags.split(",")})
    from tidal.integration.demo import warm_start

    cfg, opts = config(out, objectives[0], lags[0], a)
    warm_start(cfg, opts, out)
    runs = []
    for objective in objectives:
        for lag in lags:
            print(f"== {objective}, L = {lag}: {a.versions} versions, weights published every {lag}", flush=True)
            runs.append(run_one(out, objective, lag, a))
            print(f"   {runs[-1]['status']}, held-out {runs[-1]['final_acc']}, {runs[-1]['wall_s']:.0f} s", flush=True)
            (out / "lag.json").write_text(json.dumps({"task": TASK, "set": a.set, "runs": runs}, indent=1))
    table(runs)
    g = goal(runs)
    print(f"\ngoal ({g['text']}): {'MET' if g['met'] else 'MISSED'}; gaps in points at L = 16: "
          + ", ".join(f"{o} {v:+.1f}" for o, v in g["gap_points_at_L16"].items()))
    (out / "lag.json").write_text(json.dumps({"task": TASK, "set": a.set, "runs": runs, "goal": g}, indent=1))
    plot(runs, out / "lag.png")
    print(f"wrote {out / 'lag.png'} and {out / 'lag.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
