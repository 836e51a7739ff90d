"""Buffer benchmark: trajectories/s through ingest -> write-ahead log (fsync per drained batch) -> serve,
beside the raw tidal.core channel throughput of the same ~1 KiB trajectories, measured in this run.

    uv run python tools/bench/buffer.py [--n 40000] [--fsync batch] [--trials 3]

Path measured: a producer process pushes N trajectories through AckedPusher (resend until acked), the
buffer process acknowledges each once durable, and a learner (this process) pulls 256-sample batch
shares, acknowledging each with the next request; the rate is N / (first send -> last batch received). The baseline is
`tools/bench/transport.py`'s tidal push -> pull of the same messages. Goal: ratio >= 0.5.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import transport

from tidal.buffer import BatchClient
from tidal.core.arrays import Array
from tidal.core.protocol import Trajectory
from tidal.core.reliable import AckedPusher
from tidal.core.testing import free_endpoint

GROUP = 8
BATCH = 256


def producer(ingest: str, publish: str, n: int, conn) -> None:
    c = transport.small_content(np.random.default_rng(0))
    arrays = {k: Array.from_numpy(v) for k, v in c.items() if isinstance(v, np.ndarray)}
    base = {**c, **arrays}
    msgs = [
        Trajectory(**{**base, "id": f"t{i}", "group_id": f"g{i // GROUP}", "sample_index": i % GROUP}, source="bench")
        for i in range(n)
    ]
    with AckedPusher(ingest, publish, "bench", window=8192, resend_after=10.0, hwm=10_000) as out:
        conn.send("ready")
        conn.recv()
        t0, cpu0 = time.perf_counter(), _cpu_s()
        for m in msgs:
            out.send(m)
        out.flush(timeout=600)
        conn.send((t0, time.perf_counter(), out.resent, _cpu_s() - cpu0))


def _cpu_s(pid: str = "self") -> float:
    """User + system CPU seconds of a process so far, every thread included (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_buffer(n: int, fsync: str) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="tidal-bench-buffer-"))
    ingest, serve, publish = free_endpoint(), free_endpoint(), free_endpoint()
    proc = subprocess.Popen(
        [sys.executable, *(["-m", "cProfile", "-o", "/tmp/buf.prof"] if "TIDAL_BENCH_PROFILE" in os.environ else []), "-m", "tidal.buffer", f'ingest="{ingest}"', f'serve="{serve}"', f'publish="{publish}"',
         f'wal_dir="{tmp / "wal"}"', f"group_size={GROUP}", f"batch_samples={BATCH}", "max_groups=0",
         f'fsync="{fsync}"', "max_batch_records=512", "--log-level=WARNING"],
    )
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    prod = ctx.Process(target=producer, args=(ingest, publish, n, child), daemon=True)
    try:
        with BatchClient(serve, retry_every=1.0) as learner:
            learner.status(timeout=60)  # the service is up
            prod.start()
            assert parent.recv() == "ready"
            buffer_cpu0, learner_cpu0 = _cpu_s(str(proc.pid)), _cpu_s()
            time.sleep(0.5)  # let the ack subscription settle
            parent.send("go")
            consumed, version, done = 0, 0, None
            while consumed < n:
                batch = learner.next_batch(version, timeout=120, ack=done)  # acks the previous batch
                consumed += len(batch.trajectories)
                done = batch.batch_id
                version += 1
            learner.ack(done)
            t_end = time.perf_counter()
            learner_cpu = _cpu_s() - learner_cpu0
            t0, t_acked, resent, producer_cpu = parent.recv()
            buffer_cpu = _cpu_s(str(proc.pid)) - buffer_cpu0
    finally:
        proc.terminate()
        proc.wait(10)
        prod.join(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"tps": n / (t_end - t0), "ingest_tps": n / (t_acked - t0), "resent": resent,
            "cpu_us": {"producer": 1e6 * producer_cpu / n, "buffer": 1e6 * buffer_cpu / n, "learner": 1e6 * learner_cpu / n}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40_000, help="trajectories per trial (multiple of 256)")
    ap.add_argument("--fsync", default="batch", choices=["batch", "always", "never"])
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args(argv)
    n = args.n - args.n % BATCH
    raw, buf, ingest, cpu = [], [], [], []
    for _ in range(args.trials):  # interleaved, so machine noise hits both alike
        raw.append(transport.measure(["tidal"], "small", n, 1)["tidal"])
        r = run_buffer(n, args.fsync)
        buf.append(r["tps"])
        ingest.append(r["ingest_tps"])
        cpu.append(r["cpu_us"])
    raw_m, buf_m, ing_m = statistics.median(raw), statistics.median(buf), statistics.median(ingest)
    print(f"{'path':<46}{'trajectories/s':>16}")
    print(f"{'raw tidal.core push -> pull (baseline)':<46}{raw_m:>16,.0f}")
    print(f"{'buffer ingest -> WAL (fsync ' + args.fsync + ') -> ack':<46}{ing_m:>16,.0f}")
    print(f"{'buffer ingest -> WAL -> serve -> learner ack':<46}{buf_m:>16,.0f}")
    print(f"ratio end-to-end / raw = {buf_m / raw_m:.2f} (goal >= 0.5)")
    cpu_m = {k: statistics.median(c[k] for c in cpu) for k in cpu[0]}
    print("CPU per trajectory (us, every thread): " + ", ".join(f"{k} {v:.1f}" for k, v in cpu_m.items())
          + f"; {os.cpu_count()} cores")
    print(json.dumps({"bench": "buffer", "n": n, "fsync": args.fsync, "raw_tps": round(raw_m),
                      "buffer_ingest_tps": round(ing_m), "buffer_tps": round(buf_m),
                      "ratio": round(buf_m / raw_m, 3), "goal": 0.5,
                      "cpu_us_per_trajectory": {k: round(v, 1) for k, v in cpu_m.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
