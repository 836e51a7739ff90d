"""Buffer benchmark: trajectories/s through ingest -> write-ahead log (fsync per drained batch) -> serve,
beside the raw tidal.core channel carrying the same messages, measured in this run; swept over sample
size (1, 16, 64 KiB: 64 KiB is ~4k completion tokens of ids, logprobs and versions) and ingest unit
(a `Trajectory` per message, or a `TrajectoryGroup` of 8 per message).

    uv run python tools/bench/buffer.py [--n 40000] [--mib 256] [--sizes 1,16,64] [--units trajectory,group]
                                        [--fsync batch] [--trials 3] [--relay]

Path measured: a producer process pushes N trajectories through AckedPusher (resend until acked), the
buffer process acknowledges each message once durable, and a learner (this process) pulls 256-sample
batch shares, acknowledging each with the next request; the rate is N / (first send -> last batch
received). Baseline: a sender pushes the same messages through tidal.core push -> pull to a receiver
process that decodes them; N / (first send -> last message decoded). Goals: ratio >= 0.5 for groups at
1 KiB; >= 0.8 at 16 and 64 KiB for both units. N is `--n` at 1 KiB and `--mib` worth at larger sizes.

`--relay` adds a column for what any durable buffer must do at least, with nothing of its own: the same
messages from a sender through a relay process that writes each drained batch of them to a file, fsyncs
it (on a thread, group commit like the buffer's) and only then forwards them (zero-copy, as received) to a
receiver process that decodes them. Three processes and two hops, like the buffer's path; its ratio to
raw is a ceiling for the buffer's on this machine. The relay ends when the bench terminates it.
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
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tidal.buffer import BatchClient
from tidal.core.arrays import Array
from tidal.core.channels import pull, push
from tidal.core.process import cpu_seconds
from tidal.core.protocol import Trajectory, TrajectoryGroup
from tidal.core.reliable import AckedPusher
from tidal.core.testing import free_endpoint

GROUP = 8
BATCH = 256
UNITS = {"trajectory": 1, "group": GROUP}  # trajectories per message
GOALS = {(1, "group"): 0.5, (16, "trajectory"): 0.8, (16, "group"): 0.8, (64, "trajectory"): 0.8, (64, "group"): 0.8}
PROMPT = 32
IN_FLIGHT_BYTES = 128 * 1024**2  # producer window and socket queues hold about this much


def messages(size_kib: int, unit: str, n: int, source: str = "bench") -> Sequence[Trajectory | TrajectoryGroup]:
    """N trajectories of about `size_kib` KiB encoded (32 prompt tokens; completion ids, logprobs and
    versions at 12 bytes a token), as lone messages or groups of 8."""
    rng = np.random.default_rng(0)
    c = max(1, (size_kib * 1024 - 4 * PROMPT - 160) // 12)  # ~160 bytes of msgpack around the arrays
    arrays = dict(prompt_ids=Array.from_numpy(rng.integers(0, 32000, PROMPT, dtype=np.int32)),
                  completion_ids=Array.from_numpy(rng.integers(0, 32000, c, dtype=np.int32)),
                  logprobs=Array.from_numpy(-rng.random(c, dtype=np.float32)),
                  versions=Array.from_numpy(np.full(c, 7, np.int32)))
    trajs = [Trajectory(id=f"t{i}", group_id=f"g{i // GROUP}", sample_index=i % GROUP, task="arith", reward=1.0,
                        finish_reason="stop", source=source, group_size=GROUP, **arrays) for i in range(n)]
    if unit == "trajectory":
        return trajs
    return [TrajectoryGroup(id=f"g{j}", trajectories=trajs[j * GROUP:(j + 1) * GROUP], source=source)
            for j in range(n // GROUP)]


def _window(size_kib: int, unit: str) -> int:
    return int(min(8192, max(64, IN_FLIGHT_BYTES // (size_kib * 1024 * UNITS[unit]))))


# ----------------------------------------------------------------------------- raw channel baseline


def raw_receiver(count: int, conn) -> None:
    with pull("tcp://127.0.0.1:*", hwm=10_000) as inbox:
        conn.send(inbox.endpoint)
        for _ in range(count):
            inbox.recv(timeout=120)
        conn.send(time.perf_counter())


def run_raw(size_kib: int, unit: str, n: int) -> float:
    msgs = messages(size_kib, unit, n)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=raw_receiver, args=(len(msgs), child), daemon=True)
    proc.start()
    try:
        endpoint = parent.recv()
        with push(endpoint, hwm=_window(size_kib, unit), linger=60) as out:
            time.sleep(0.2)  # connected
            t0 = time.perf_counter()
            for m in msgs:
                out.send(m)
            t_end = parent.recv() if parent.poll(300) else float("nan")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return n / (t_end - t0)


# ----------------------------------------------------------------------------- durable relay (a bound)


def relay(out_endpoint: str, wal_dir: str, conn) -> None:
    """PULL -> writev of each drained batch -> fsync (on a thread, covering every batch written while the
    last one ran, as the buffer's group commit does) -> PUSH the same frames on: a buffer's least work."""
    import queue
    import threading

    import zmq

    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.rcvhwm = outbox.sndhwm = 10_000
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    outbox.connect(out_endpoint)
    conn.send(f"tcp://127.0.0.1:{port}")
    fd = os.open(Path(wal_dir) / "relay.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    written: queue.Queue = queue.Queue()

    def sync_and_forward() -> None:  # the only user of outbox
        while True:
            batches = [written.get()]
            while not written.empty():
                batches.append(written.get())
            os.fsync(fd)
            for batch in batches:
                for m in batch:
                    outbox.send_multipart(m, copy=False)

    threading.Thread(target=sync_and_forward, daemon=True).start()
    while inbox.poll(120_000):
        batch = []
        while len(batch) < 512:
            try:
                batch.append(inbox.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
        pieces = [f.buffer for m in batch for f in m]
        for i in range(0, len(pieces), 1024):
            os.writev(fd, pieces[i:i + 1024])
        written.put(batch)


def run_relay(size_kib: int, unit: str, n: int) -> float:
    msgs = messages(size_kib, unit, n)
    tmp = tempfile.mkdtemp(prefix="tidal-bench-relay-")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    rparent, rchild = ctx.Pipe()
    receiver = ctx.Process(target=raw_receiver, args=(len(msgs), child), daemon=True)
    receiver.start()
    relayer = None
    try:
        relayer = ctx.Process(target=relay, args=(parent.recv(), tmp, rchild), daemon=True)
        relayer.start()
        with push(rparent.recv(), hwm=_window(size_kib, unit), linger=60) as out:
            time.sleep(0.2)  # connected
            t0 = time.perf_counter()
            for m in msgs:
                out.send(m)
            t_end = parent.recv() if parent.poll(300) else float("nan")
    finally:
        if relayer is not None:  # it waits for more otherwise
            relayer.terminate()
            relayer.join(10)
        receiver.join(10)
        for p in (receiver, relayer):
            if p is not None and p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(tmp, ignore_errors=True)
    return n / (t_end - t0)


# ----------------------------------------------------------------------------- through the buffer


def producer(ingest: str, publish: str, size_kib: int, unit: str, n: int, conn) -> None:
    msgs = messages(size_kib, unit, n)
    window = _window(size_kib, unit)
    with AckedPusher(ingest, publish, "bench", window=window, resend_after=30.0, hwm=2 * window) as out:
        conn.send("ready")
        conn.recv()
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        for m in msgs:
            out.send(m)
        out.flush(timeout=600)
        conn.send((t0, time.perf_counter(), out.resent, cpu_seconds() - cpu0))


def run_buffer(size_kib: int, unit: str, n: int, fsync: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="tidal-bench-buffer-"))
    ingest, serve, publish = free_endpoint(), free_endpoint(), free_endpoint()
    profile = os.environ.get("TIDAL_BENCH_PROFILE")  # a folder: the buffer's cProfile per cell lands there
    prof = ["-m", "cProfile", "-o", f"{profile}/buffer-{size_kib}k-{unit}.prof"] if profile else []
    proc = subprocess.Popen(
        [sys.executable, *prof, "-m", "tidal.buffer", f'ingest="{ingest}"', f'serve="{serve}"', f'publish="{publish}"',
         f'wal_dir="{tmp / "wal"}"', f"group_size={GROUP}", f"batch_samples={BATCH}", "max_groups=0",
         f'fsync="{fsync}"', "max_batch_records=512", "--log-level=WARNING"],
    )
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    prod = ctx.Process(target=producer, args=(ingest, publish, size_kib, unit, n, child), daemon=True)
    try:
        with BatchClient(serve, retry_every=1.0) as learner:
            learner.status(timeout=60)  # the service is up
            prod.start()
            assert parent.recv() == "ready"
            buffer_cpu0, learner_cpu0 = cpu_seconds(str(proc.pid)), cpu_seconds()
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
            learner_cpu = cpu_seconds() - learner_cpu0
            t0, t_acked, resent, producer_cpu = parent.recv()
            buffer_cpu = cpu_seconds(str(proc.pid)) - buffer_cpu0
    finally:
        proc.terminate()
        proc.wait(10)
        prod.join(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"tps": n / (t_end - t0), "ingest_tps": n / (t_acked - t0), "resent": resent,
            "cpu_us": {"producer": 1e6 * producer_cpu / n, "buffer": 1e6 * buffer_cpu / n, "learner": 1e6 * learner_cpu / n}}


# ----------------------------------------------------------------------------- sweep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40_000, help="trajectories per 1 KiB trial (rounded to 256)")
    ap.add_argument("--mib", type=float, default=256, help="MiB of trajectories per trial at larger sizes")
    ap.add_argument("--sizes", default="1,16,64", help="sample sizes in KiB")
    ap.add_argument("--units", default="trajectory,group", help="ingest units: trajectory, group")
    ap.add_argument("--fsync", default="batch", choices=["batch", "always", "never"])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--relay", action="store_true", help="also measure a durable relay (a ceiling; see above)")
    args = ap.parse_args(argv)
    cells = [(int(s), u) for s in args.sizes.split(",") for u in args.units.split(",")]
    if any(u not in UNITS for _, u in cells):
        ap.error(f"--units takes {', '.join(UNITS)}")
    rows = []
    for size, unit in cells:
        n = args.n if size == 1 else int(args.mib * 1024 // size)
        n = max(BATCH, n - n % BATCH)
        raw, buf, ingest, cpu, rel = [], [], [], [], []
        for _ in range(args.trials):  # interleaved, so machine noise hits both alike
            raw.append(run_raw(size, unit, n))
            if args.relay:
                rel.append(run_relay(size, unit, n))
            r = run_buffer(size, unit, n, args.fsync)
            buf.append(r["tps"])
            ingest.append(r["ingest_tps"])
            cpu.append(r["cpu_us"])
        raw_m, buf_m = statistics.median(raw), statistics.median(buf)
        rows.append({"size_kib": size, "unit": unit, "n": n, "raw_tps": round(raw_m), "buffer_tps": round(buf_m),
                     "buffer_ingest_tps": round(statistics.median(ingest)), "ratio": round(buf_m / raw_m, 3),
                     "goal": GOALS.get((size, unit)),
                     "cpu_us_per_trajectory": {k: round(statistics.median(c[k] for c in cpu), 1) for k in cpu[0]}})
        if rel:
            rows[-1]["relay_tps"] = round(statistics.median(rel))
            rows[-1]["relay_ratio"] = round(statistics.median(rel) / raw_m, 3)
    relay_head = f"{'relay':>7}" if args.relay else ""
    print(f"{'size':>6} {'unit':<11}{'raw traj/s':>12}{'ingest':>12}{'end-to-end':>12}{'ratio':>7}{'goal':>6}{relay_head}"
          f"   CPU us/traj: producer buffer learner")
    for r in rows:
        c = r["cpu_us_per_trajectory"]
        goal = f"{r['goal']:.1f}" if r["goal"] else "-"
        relay_col = f"{r['relay_ratio']:>7.2f}" if "relay_ratio" in r else ""
        print(f"{r['size_kib']:>4}Ki {r['unit']:<11}{r['raw_tps']:>12,}{r['buffer_ingest_tps']:>12,}{r['buffer_tps']:>12,}"
              f"{r['ratio']:>7.2f}{goal:>6}{relay_col}   {c['producer']:>8.1f} {c['buffer']:>6.1f} {c['learner']:>7.1f}")
    print(f"ratio = end-to-end (ingest -> WAL fsync {args.fsync} -> ack; serve -> learner ack) / raw push -> pull "
          f"of the same messages; {os.cpu_count()} cores")
    if args.relay:
        print("relay = the same messages through a process that only writev's + fsyncs each drained batch and "
              "forwards it, / raw: a ceiling for the ratio here")
    met = all(r["ratio"] >= r["goal"] for r in rows if r["goal"])
    print(json.dumps({"bench": "buffer", "fsync": args.fsync, "trials": args.trials, "cells": rows, "goals_met": met}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
