"""Learning at large policy lag: the same task and budget with the learner publishing its weights only every
L steps (`learner.weights.every = L`, OAPL's "lag by design"; `max_staleness = max(2, L - 1)` so the depth
gate lets generation run that far ahead), for the default objective, OAPL and M2PO. Held-out accuracy
against samples trained, one PNG with every curve and a JSON summary.

    uv run --locked --all-packages python tools/study/lag.py        # L = 1, 4, 16, 64 x 3 objectives x 3 seeds
    uv run --locked --all-packages python tools/study/lag.py --lags 1,16 --objectives default,m2po --seeds 1

Every run is a real `tidal run` (rollout worker, buffer, learner and controller as processes) from the
demo's warm start (built once in --out, reused), with the demo's recipe (integration/recipes/arithmetic.toml)
and these objectives:
- default: the recipe's, PPO clip 0.2 / 0.28 (DAPO clip-higher) with token TIS (cap 2) and GRPO advantages;
- oapl: OAPL's squared regression on the lagged policy's sequence log-ratio, its softmax group value;
- m2po: M2PO's second-moment masking (no clip, no TIS), GRPO advantages.

Task, and why: the demo's (arithmetic level 5, the tiny model) made harder in two ways (TASK). The
warm start's demonstrator forgets the carry 90 % of the time (the demo's: 60 %), so the carry digit starts
at ~10 % probability and RL must raise it several-fold before greedy decoding picks it; and a step is 2
groups of 8 (16 samples), so a publish period of L steps holds few samples. From the demo's own warm start
lag does not hurt the default even at L = 64 (measured with 16-sample steps: 93.6 % held-out at version 64 with every sample from
version 0, against 92.7 % at L = 1): PPO's clip, taken against the sampler's logprobs, stops each period's
move at ratio 1.28 (the gradient norm falls to ~0 within ~24 steps of a period), but a greedy evaluation
there needs only a small move. Here it needs many periods' worth, which is where a clip bounded per period
costs the default and an objective built for lag should not.
Every run is bounded by --minutes (the budget in versions is the same for all; a run stopped by the clock
is reported as such, never compared). Prints per (objective, L) the held-out accuracy at the last version
(mean over seeds, and each seed's), the gap to L = 1, mean and max lag, and the issue's goal: at L = 16,
OAPL or M2PO ends within 5 points of its L = 1 run while the default loses more.
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

# what each objective overrides in the recipe, and whether it keeps the recipe's staleness correction
# (OAPL refuses one; M2PO's masking is its own correction)
OBJECTIVES: dict[str, tuple[list[str], bool]] = {
    "default": ([], True),
    "oapl": (['learner.train.loss={ name = "oapl" }', 'learner.train.advantage={ name = "oapl" }'], False),
    "m2po": (['learner.train.loss={ name = "m2po" }', 'learner.train.advantage={ name = "grpo" }'], False),
}
# harder than the demo (its warm start has the carry 40 % of the time and fixes it within ~30 versions):
# a demonstrator that forgets the carry 90 % of the time, and a shorter SFT
TASK = ["sft.carry_slip=0.9", "sft.steps=600", "batch_groups=2"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/study-lag", help="warm start (reused) and one run folder per curve")
    ap.add_argument("--lags", default="1,4,16,64", help="publish periods L, comma-separated")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES), help=f"of {', '.join(OBJECTIVES)}")
    ap.add_argument("--versions", type=int, default=192, help="learner steps per run (16 samples each)")
    ap.add_argument("--eval-every", type=int, default=16, help="held-out rounds every N versions (at published ones)")
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock bound per run")
    ap.add_argument("--seeds", type=int, default=3, help="runs per (objective, L), seeds 0..N-1 (their mean is compared)")
    ap.add_argument("--set", action="append", default=[], metavar="[OBJECTIVE:]FIELD=VALUE",
                    help="a recipe override (repeatable) for every run, e.g. learner.backend.options.optim.lr=3e-4, "
                         "or for one objective's runs: oapl:learner.train.loss.options.beta=0.1")
    return ap.parse_args()


def config(out: Path, objective: str, lag: int, seed: int, a: argparse.Namespace) -> Any:
    from tidal.integration.demo import demo_config

    overrides, keeps_correction = OBJECTIVES[objective]
    cfg, opts = demo_config(out, [
        *TASK, f'run_dir="{out / f"{objective}-L{lag}-s{seed}"}"', f"budget.versions={a.versions}",
        f"budget.minutes={a.minutes}", f"eval.every={a.eval_every}", f"learner.weights.every={lag}",
        f"max_staleness={max(2, lag - 1)}", "monitor.progress=off", "monitor.tensorboard=false", *overrides,
        *sets(a, objective), f"seed={seed}"])
    if keeps_correction:
        return cfg, opts
    train = msgspec.structs.replace(cfg.learner.train, correction=None)
    return msgspec.structs.replace(cfg, learner=msgspec.structs.replace(cfg.learner, train=train)), opts


def sets(a: argparse.Namespace, objective: str) -> list[str]:
    """The --set overrides for `objective`'s runs: those without a prefix, and those prefixed with its name."""
    out = []
    for s in a.set:
        prefix, colon, rest = s.partition(":")
        if colon and prefix in OBJECTIVES and "=" not in prefix:
            if prefix == objective:
                out.append(rest)
        else:
            out.append(s)
    return out


def run_one(out: Path, objective: str, lag: int, seed: int, a: argparse.Namespace) -> dict[str, Any]:
    """One run (from the warm start made with seed 0; `seed` draws its tasks and samples); its held-out
    curve against samples trained, its lag and its wall time."""
    from tidal.integration.recipe import check
    from tidal.integration.run import run

    cfg, _ = config(out, objective, lag, seed, a)
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
    return {"objective": objective, "lag": lag, "seed": seed, "status": result.status, "versions": result.versions,
            "complete": result.status == "completed" and result.versions >= a.versions, "curve": curve,
            "final_acc": curve[-1]["acc"] if curve else None, "lag_mean": sum(lags) / max(len(lags), 1),
            "lag_max": max((s.get("staleness/lag_max", 0.0) for s in learner.values()), default=0.0),
            "skipped_steps": max((s.get("train/skipped_steps_total", 0.0) for s in learner.values()), default=0.0),
            "wall_s": time.time() - t0, "run_dir": str(run_dir)}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (objective, L), over its complete seeds: the mean final accuracy, each seed's, and the mean
    curve at the versions every seed evaluated (the published ones)."""
    out = []
    for key in dict.fromkeys((r["objective"], r["lag"]) for r in runs):
        done = [r for r in runs if (r["objective"], r["lag"]) == key and r["complete"]]
        if not done:
            out.append({"objective": key[0], "lag": key[1], "seeds": 0, "final_acc": None, "curve": []})
            continue
        common = set.intersection(*({p["version"] for p in r["curve"]} for r in done))
        curve = [{"version": v, "samples": max(p["samples"] for r in done for p in r["curve"] if p["version"] == v),
                  "acc": sum(p["acc"] for r in done for p in r["curve"] if p["version"] == v) / len(done)}
                 for v in sorted(common)]
        finals = [r["final_acc"] for r in done]
        mean = sum(finals) / len(finals)
        # the standard error of that mean over seeds: what a gap between two rows must beat to mean much
        sem = (sum((x - mean) ** 2 for x in finals) / (len(finals) - 1) / len(finals)) ** 0.5 if len(finals) > 1 else None
        out.append({"objective": key[0], "lag": key[1], "seeds": len(done), "final_acc": mean, "sem": sem,
                    "finals": finals, "curve": curve,
                    "lag_mean": sum(r["lag_mean"] for r in done) / len(done), "lag_max": max(r["lag_max"] for r in done),
                    "skipped_steps": sum(r["skipped_steps"] for r in done),
                    "wall_s": sum(r["wall_s"] for r in done) / len(done)})
    return out


def goal(summary: list[dict[str, Any]]) -> dict[str, Any]:
    """At L = 16: the gap (points) of each objective's mean final held-out accuracy to its own L = 1's."""
    by = {(r["objective"], r["lag"]): r["final_acc"] for r in summary if r["final_acc"] is not None}
    gaps = {o: 100 * (by[(o, 1)] - by[(o, 16)]) for o in OBJECTIVES if (o, 1) in by and (o, 16) in by}
    off = {o: g for o, g in gaps.items() if o != "default"}
    met = bool(off) and "default" in gaps and min(off.values()) <= 5.0 and gaps["default"] > min(off.values())
    return {"gap_points_at_L16": gaps, "met": met,
            "text": "at L = 16, OAPL or M2PO within 5 points of its L = 1 run, the default losing more"}


def table(summary: list[dict[str, Any]]) -> None:
    base = {r["objective"]: r["final_acc"] for r in summary if r["lag"] == 1 and r["final_acc"] is not None}
    print(f"\n{'objective':<9} {'L':>3} {'seeds':>5} {'final acc':>9} {'± sem':>6} {'vs L=1':>7} {'per seed':<22} "
          f"{'lag mean':>8} {'lag max':>7} {'skipped':>7} {'wall s':>6}")
    for r in summary:
        acc = r["final_acc"]
        if acc is None:
            print(f"{r['objective']:<9} {r['lag']:>3} {0:>5}  no complete run (not compared)")
            continue
        gap = f"{100 * (acc - base[r['objective']]):+.1f}" if r["objective"] in base else "-"
        seeds = " ".join(f"{100 * x:.1f}" for x in r["finals"])
        sem = "-" if r["sem"] is None else f"{100 * r['sem']:.1f}"
        print(f"{r['objective']:<9} {r['lag']:>3} {r['seeds']:>5} {f'{100 * acc:.1f}%':>9} {sem:>6} {gap:>7} {seeds:<22} "
              f"{r['lag_mean']:>8.1f} {r['lag_max']:>7.0f} {r['skipped_steps']:>7.0f} {r['wall_s']:>6.0f}")


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend: a display-less one

    objectives = list(dict.fromkeys(r["objective"] for r in summary))
    fig, axes = plt.subplots(1, len(objectives), figsize=(5 * len(objectives), 4), sharey=True, squeeze=False)
    for ax, objective in zip(axes[0], objectives, strict=True):
        for r in (r for r in summary if r["objective"] == objective and r["curve"]):
            ax.plot([p["samples"] for p in r["curve"]], [100 * p["acc"] for p in r["curve"]], marker="o", ms=3,
                    label=f"L = {r['lag']} ({r['seeds']} seed{'s' if r['seeds'] != 1 else ''})")
        ax.set_title(objective)
        ax.set_xlabel("samples trained")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("held-out accuracy (%), mean over seeds")
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

    cfg, opts = config(out, objectives[0], lags[0], 0, a)
    warm_start(cfg, opts, out)  # one warm start (seed 0) for every run
    runs: list[dict[str, Any]] = []
    meta = {"task": TASK, "set": a.set, "versions": a.versions, "seeds": a.seeds}
    for objective in objectives:
        for lag in lags:
            for seed in range(a.seeds):
                print(f"== {objective}, L = {lag}, seed {seed}: {a.versions} versions", flush=True)
                runs.append(run_one(out, objective, lag, seed, a))
                r = runs[-1]
                print(f"   {r['status']}, held-out {r['final_acc']}, {r['wall_s']:.0f} s", flush=True)
                (out / "lag.json").write_text(json.dumps({**meta, "runs": runs}, indent=1))
    summary = summarize(runs)
    table(summary)
    g = goal(summary)
    print(f"\ngoal ({g['text']}): {'MET' if g['met'] else 'MISSED'}; gaps in points at L = 16: "
          + ", ".join(f"{o} {v:+.1f}" for o, v in g["gap_points_at_L16"].items()))
    (out / "lag.json").write_text(json.dumps({**meta, "summary": summary, "goal": g, "runs": runs}, indent=1))
    plot(summary, out / "lag.png")
    print(f"wrote {out / 'lag.png'} and {out / 'lag.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
