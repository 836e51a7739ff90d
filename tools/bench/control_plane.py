"""The control plane at scale: one controller, one buffer and a learner against 8 ... 256 rollout workers.

    uv run python tools/bench/control_plane.py [--workers 8,32,128,256] [--versions 40] [--fetch-weights]

Each count starts the real system (`tidal.integration.run`: the driver with its controller, the buffer,
the learner, N rollout worker processes, every channel authenticated) with the `simulated` engine, which
sleeps instead of generating, so one machine hosts many workers. Every worker offers the same load
(`--slots` sequences of median `--median-tokens` at `--token-ms` a decode step), the learner's batch grows
with N (`--batch-per-worker` samples per worker) and a step takes `--step-ms` (simulated), so versions come
at the same pace at every count, and `max_staleness` is wide, so
the depth gate does not hold the workers back: what is measured is the control plane carrying the load.
Without `--fetch-weights` a worker takes each announced version without moving the bytes (torch, which
the weight receiver needs, costs ~300 MB per process); with it, every worker fetches every version from
the learner (N copies).

Measured in the steady window (every worker connected, up to the learner's last step), per count:
- CPU of the driver process (the controller's loop, and the metrics it writes) and of the buffer, as a
  share of one core, sampled from /proc (the sampling thread's own time left out); per worker, and per
  message (controller: every message a worker sends it) or per trajectory (buffer: ingest, WAL, serve);
- messages per second into the controller, trajectories per second into the buffer;
- version -> all: from the learner's announcement of a version to the last live worker reporting it
  holds it (the controller's own measure, median and max of the last 200 versions);
- heartbeat age: how old a worker's heartbeat is when the controller's loop takes it (its backlog);
- credit round trip: from a worker asking for work to the assignment arriving (the workers' medians).

Then the saturation point: the worker count at which the controller (or the buffer) would need a whole
core, at this per-worker rate, from the largest count's per-message cost. On a machine with fewer cores
than the roles need, everything shares them: the per-message costs still hold, the latencies then say
how the machine copes. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tidal.core.config import convert
from tidal.core.process import cpu_seconds
from tidal.integration.recipe import RunConfig
from tidal.integration.run import run
from tidal.rollout.tiny import build_tiny_model


def recipe(model: Path, run_dir: Path, n: int, a: argparse.Namespace) -> RunConfig:
    batch = a.batch_per_worker * n
    return convert({
        "name": f"control-plane-{n}", "run_dir": str(run_dir), "mode": "async", "model": str(model),
        "group_size": a.group_size, "batch_groups": max(1, batch // a.group_size), "max_staleness": 10_000,
        "workers": n, "sampling": {"temperature": 1.0, "max_tokens": 4 * a.median_tokens, "stop": []},
        "eval": {"every": 0}, "budget": {"versions": a.versions},
        "rollout": {"max_groups": max(1, a.slots // a.group_size), "metrics_interval_s": 2.0,
                    "engine": {"name": "simulated", "options": {
                        "token_s": a.token_ms / 1e3, "max_num_seqs": a.slots, "median_tokens": a.median_tokens,
                        "sigma": 0.5, "fetch_weights": a.fetch_weights}}},
        # a step every --step-ms, whatever the batch: the steady window is `versions` steps long
        "learner": {"checkpoint_every": 0, "simulate_s_per_sample": a.step_ms / 1e3 / batch,
                    "backend": {"options": {"optim": {"lr": 1e-5}}},
                    # version-only workers never fetch the last version: do not wait for them to
                    "weights": {"final_wait_s": 30.0 if a.fetch_weights else 0.0}},
        # the simulated engine learns nothing by design: this measures the control plane, not learning
        "launch": {"start_timeout_s": 600.0, "heartbeat_timeout_s": 120.0, "fail_without_signal": False},
        "monitor": {"progress": "off", "tensorboard": False},
    }, RunConfig, source="control-plane bench")


def _cpu(pid: int | str = "self", thread: int | None = None) -> float:
    """`cpu_seconds`, or 0 for a process or thread that ended since it was listed."""
    try:
        return cpu_seconds(pid, thread)
    except ProcessLookupError:
        return 0.0


class CpuSampler(threading.Thread):
    """Every `period` s: (wall clock, driver CPU s without this thread, {role: CPU s}) from /proc."""

    def __init__(self, run_dir: Path, period: float = 0.5) -> None:
        super().__init__(name="cpu-sampler", daemon=True)
        self.run_dir, self.period = run_dir, period
        self.samples: list[tuple[float, float, dict[str, float]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        me = threading.get_native_id()
        while not self.stop.wait(self.period):
            driver = sum(_cpu(thread=int(t.name))
                         for t in Path("/proc/self/task").iterdir() if int(t.name) != me)
            try:
                pids = json.loads((self.run_dir / "pids.json").read_text())
            except (OSError, ValueError):
                pids = {}
            roles = {name: _cpu(pid) for name, pid in pids.items()}
            self.samples.append((time.time(), driver, roles))

    def share(self, t0: float, t1: float, pick: Any) -> float:
        """The CPU share of one core of `pick(sample)` between the samples nearest t0 and t1."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            raise RuntimeError(f"{len(inside)} CPU samples in the steady window: run more --versions")
        (ta, *a), (tb, *b) = inside[0], inside[-1]
        return (pick(b) - pick(a)) / (tb - ta)


def measure(run_dir: Path, n: int, cpu: CpuSampler) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ctl = [r for r in rows if r["source"] == "controller"]
    steps = [r for r in rows if r["source"] == "learner-0"]
    up = next((r["time"] for r in ctl if r["scalars"].get("controller/workers_alive", 0) >= n), None)
    if up is None or not steps:
        raise RuntimeError(f"{run_dir}: the {n} workers never all connected, or the learner never stepped")
    t0, t1 = max(up, steps[0]["time"]), steps[-1]["time"]
    window = [r for r in ctl if t0 <= r["time"] <= t1]
    if len(window) < 2:
        raise RuntimeError(f"{run_dir}: {len(window)} controller rows in the steady window: run more --versions")
    first, last = window[0], window[-1]
    dt = last["time"] - first["time"]

    def rate(key: str, src: list[dict[str, Any]] = window) -> float:
        return (src[-1]["scalars"][key] - src[0]["scalars"][key]) / (src[-1]["time"] - src[0]["time"])

    buf = [r for r in rows if r["source"] == "buffer" and t0 <= r["time"] <= t1]
    workers = [r for r in rows if r["source"].startswith("rollout-") and t0 <= r["time"] <= t1]
    rtts = [r["scalars"]["rollout/credit_rtt_ms"] for r in workers if "rollout/credit_rtt_ms" in r["scalars"]]
    s = last["scalars"]
    ctl_cpu = cpu.share(first["time"], last["time"], lambda x: x[0])
    buf_cpu = cpu.share(first["time"], last["time"], lambda x: x[1].get("buffer", 0.0))
    worker_cpu = cpu.share(first["time"], last["time"],
                           lambda x: sum(v for k, v in x[1].items() if k.startswith("rollout-"))) / n
    msgs = rate("controller/messages_in")
    traj = rate("total/accepted", buf) if len(buf) >= 2 else 0.0
    return {
        "workers": n, "window_s": dt, "groups_per_s": rate("controller/groups_done"),
        "ctl_msgs_per_s": msgs, "ctl_cpu": ctl_cpu, "ctl_us_per_msg": 1e6 * ctl_cpu / msgs if msgs else 0.0,
        "buf_traj_per_s": traj, "buf_cpu": buf_cpu, "buf_us_per_traj": 1e6 * buf_cpu / traj if traj else 0.0,
        "version_to_all_ms_median": s.get("controller/version_to_all_ms_median", float("nan")),
        "version_to_all_ms_max": s.get("controller/version_to_all_ms_max", float("nan")),
        "heartbeat_age_ms_median": s.get("controller/heartbeat_age_ms_median", float("nan")),
        "credit_rtt_ms_median": statistics.median(rtts) if rtts else float("nan"),
        "worker_cpu": worker_cpu, "versions": len(steps),
    }


def saturate(rows: list[dict[str, float]], cpu: str, per_s: str) -> dict[str, float]:
    """A least-squares line through (load, CPU share) over the counts: the fixed part (the loop's own
    polling, its status rows) and the cost of each message or trajectory; and the load, and the worker
    count at the largest count's per-worker rate, at which the role needs a whole core."""
    xs, ys = [r[per_s] for r in rows], [r[cpu] for r in rows]
    if len(rows) >= 2 and max(xs) > min(xs):
        slope, fixed = statistics.linear_regression(xs, ys)
    else:  # one count: all of its CPU counted as per-message cost
        slope, fixed = (ys[0] / xs[0] if xs[0] else 0.0), 0.0
    per_worker = rows[-1][per_s] / rows[-1]["workers"]
    at_core = (1.0 - fixed) / slope if slope > 0 else float("inf")
    return {"fixed_cpu": fixed, "us_each": 1e6 * slope, "per_s_at_one_core": at_core, "per_worker": per_worker,
            "workers_at_one_core": at_core / per_worker if per_worker else float("inf")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="8,32,128,256", help="worker counts, comma-separated")
    ap.add_argument("--versions", type=int, default=40, help="learner steps per count (the steady window)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8, help="sequences each worker generates at once")
    ap.add_argument("--token-ms", type=float, default=50.0, help="simulated decode step time")
    ap.add_argument("--median-tokens", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=500.0, help="learner step time (simulated)")
    ap.add_argument("--batch-per-worker", type=int, default=2, help="learner batch samples per worker")
    ap.add_argument("--out", default="", help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--fetch-weights", action="store_true",
                    help="every worker fetches every version's bytes (loads torch: ~300 MB per worker)")
    a = ap.parse_args()
    counts = [int(x) for x in a.workers.split(",")]
    got = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = a.out or scratch
        model = build_tiny_model(Path(tmp) / "model", hidden=64, heads=2, kv_heads=1, layers=1, intermediate=128)
        for n in counts:
            run_dir = Path(tmp) / f"w{n}"
            cpu = CpuSampler(run_dir)
            cpu.start()
            t = time.monotonic()
            try:
                result = run(recipe(model, run_dir, n, a))
            finally:
                cpu.stop.set()
                cpu.join()
            if result.status != "completed":
                raise SystemExit(f"{n} workers: run {result.status}; logs in {run_dir / 'logs'}")
            got.append(measure(run_dir, n, cpu))
            print(f"{n} workers done in {time.monotonic() - t:.0f} s", flush=True)
    print(f"{'workers':>7} {'groups/s':>8} {'ctl msg/s':>9} {'ctl cpu':>7} {'us/msg':>6} {'buf traj/s':>10} "
          f"{'buf cpu':>7} {'us/traj':>7} {'v->all ms':>13} {'hb age ms':>9} {'credit ms':>9} {'worker cpu':>10}")
    for r in got:
        print(f"{r['workers']:>7} {r['groups_per_s']:>8.1f} {r['ctl_msgs_per_s']:>9.0f} {r['ctl_cpu']:>7.1%} "
              f"{r['ctl_us_per_msg']:>6.0f} {r['buf_traj_per_s']:>10.0f} {r['buf_cpu']:>7.1%} {r['buf_us_per_traj']:>7.0f} "
              f"{r['version_to_all_ms_median']:>6.0f}/{r['version_to_all_ms_max']:<6.0f} {r['heartbeat_age_ms_median']:>9.1f} "
              f"{r['credit_rtt_ms_median']:>9.1f} {r['worker_cpu']:>10.1%}")
    saturation = {"controller": saturate(got, "ctl_cpu", "ctl_msgs_per_s"), "buffer": saturate(got, "buf_cpu", "buf_traj_per_s")}
    for role, what, each in (("controller", "messages", "message"), ("buffer", "trajectories", "trajectory")):
        s = saturation[role]
        if s["us_each"] <= 0:  # its CPU did not grow with the load: the fixed part is all there is to see
            print(f"{role}: {1e3 * s['fixed_cpu']:.1f} ms of CPU a second; no cost per {each} measurable at these "
                  f"loads ({s['per_worker']:.2f} {what}/s per worker): run more workers")
            continue
        print(f"{role}: {1e3 * s['fixed_cpu']:.1f} ms of CPU a second plus {s['us_each']:.0f} us per {each}: one core "
              f"at ~{s['per_s_at_one_core']:.0f} {what}/s, ~{s['workers_at_one_core']:.0f} workers at {s['per_worker']:.2f} "
              f"{what}/s each")
    print(json.dumps({"bench": "control_plane", "rows": got, "saturation": saturation, "args": vars(a)}))


if __name__ == "__main__":
    main()
