"""Async against sync with the real roles, simulated costs: what the pipeline itself is worth.

    uv run python tools/bench/pipeline.py [--versions 24] [--token-ms 20] [--train-ms 25] [--sigma 1.0]

Both runs start the real system (`tidal.integration.run`: rollout workers, buffer, learner, controller,
weights over ZeroMQ after every step) on the same recipe and sample budget. Only the costs are simulated:
the `simulated` engine sleeps `--token-ms` per decode step (all running sequences advance together, as in
a memory-bound GPU engine) with completion lengths drawn from a log-normal long tail (median
`--median-tokens`, `--sigma`, capped at `--max-tokens`); the learner sleeps `--train-ms` per trained sample
on top of its (tiny) real step.

Throughput = samples trained / wall time between the first and last learner steps. The ideal bound of
any pipeline is one batch per max(G, T): G = a batch's generation time with every engine slot busy
(B x mean length x token time / (slots x workers)), T = a batch's train time (B x train time per
sample). Prints a table and one JSON line with async/sync and async/ideal.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
from pathlib import Path

from tidal.core.config import convert
from tidal.integration.run import run
from tidal.rollout.tiny import build_tiny_model


def recipe(model: Path, run_dir: Path, mode: str, a: argparse.Namespace) -> object:
    return convert({
        "name": f"pipeline-{mode}", "run_dir": str(run_dir), "mode": mode, "model": str(model),
        "group_size": a.group_size, "batch_groups": a.batch_groups, "max_staleness": a.max_staleness,
        "workers": a.workers, "sampling": {"temperature": 1.0, "max_tokens": a.max_tokens, "stop": []},
        "eval": {"every": 0}, "budget": {"versions": a.versions},
        "rollout": {"max_groups": a.slots // a.group_size * 2, "metrics_interval_s": 2.0,
                    "engine": {"name": "simulated", "options": {
                        "token_s": a.token_ms / 1e3, "max_num_seqs": a.slots, "median_tokens": a.median_tokens,
                        "sigma": a.sigma}}},
        "buffer": {"fsync": "never"},
        "learner": {"simulate_s_per_sample": a.train_ms / 1e3, "checkpoint_every": 0,
                    "backend": {"options": {"optim": {"lr": 1e-5}}}},
        "monitor": {"progress": "off", "tensorboard": False},
        # the simulated engine learns nothing by design: this measures the pipeline, not learning
        "launch": {"fail_without_signal": False},
    }, __import__("tidal.integration.recipe", fromlist=["RunConfig"]).RunConfig, source="pipeline bench")


def throughput(run_dir: Path) -> tuple[float, int, dict[str, float]]:
    """Samples/s between the first and the last learner step, steps, and where a learner step's time went."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["source"] == "learner-0"]
    if len(steps) < 3:
        raise RuntimeError(f"{run_dir}: only {len(steps)} learner steps recorded")
    samples = sum(r["scalars"]["train/sequences"] for r in steps[1:])
    parts = {k: sum(r["scalars"][f"train/{k}"] for r in steps[1:]) / (len(steps) - 1)
             for k in ("step_s", "wait_batch_s", "compute_s")}
    return samples / (steps[-1]["time"] - steps[0]["time"]), len(steps), parts


def mean_length(a: argparse.Namespace, n: int = 20000) -> float:
    rng = random.Random(0)
    return sum(max(1, min(a.max_tokens, math.ceil(a.median_tokens * math.exp(a.sigma * rng.gauss(0, 1)))))
               for _ in range(n)) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=24, help="learner steps per run (same sample budget both ways)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=64, help="sequences each simulated engine decodes at once")
    ap.add_argument("--token-ms", type=float, default=20.0, help="simulated decode step time")
    ap.add_argument("--train-ms", type=float, default=25.0, help="simulated train time per sample")
    ap.add_argument("--median-tokens", type=int, default=16)
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of completion lengths (long tail)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-staleness", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(tmp / "model", hidden=64, heads=2, kv_heads=1, layers=1, intermediate=128)
        got = {}
        for mode in ("sync", "async"):
            result = run(recipe(model, tmp / mode, mode, a))
            if result.status != "completed":
                raise SystemExit(f"{mode} run {result.status}; logs in {tmp / mode / 'logs'}")
            got[mode] = throughput(tmp / mode)
    b = a.group_size * a.batch_groups
    g = b * mean_length(a) * a.token_ms / 1e3 / (a.slots * a.workers)
    t = b * a.train_ms / 1e3
    ideal = b / max(g, t)
    (sync, _, _), (asyn, steps, _) = got["sync"], got["async"]
    print(f"batch {b} samples; G = {g:.2f} s, T = {t:.2f} s per batch; ideal {ideal:.1f} samples/s")
    print(f"{'mode':<6} {'samples/s':>10} {'step s':>8} {'wait s':>8} {'train s':>8}  (learner, mean per step)")
    for mode in ("sync", "async"):
        tp, _, p = got[mode]
        print(f"{mode:<6} {tp:>10.1f} {p['step_s']:>8.2f} {p['wait_batch_s']:>8.2f} {p['compute_s']:>8.2f}")
    print(f"async / sync = {asyn / sync:.2f}x   async / ideal = {asyn / ideal:.2f}")
    print(json.dumps({"bench": "pipeline", "sync_samples_per_s": sync, "async_samples_per_s": asyn,
                      "async_over_sync": asyn / sync, "async_over_ideal": asyn / ideal, "G_s": g, "T_s": t,
                      "steps": steps, "args": vars(a)}))


if __name__ == "__main__":
    main()
