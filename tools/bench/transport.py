"""Transport benchmark: tidal.core channels against raw pyzmq baselines, two processes, tcp loopback.

    uv run python tools/bench/transport.py [--small N] [--large N] [--trials K]

Workloads:
  small  ~1 KiB trajectories (32 prompt + 64 completion tokens, logprobs, versions), messages/s
  large  64 MiB float32 tensor payloads, GB/s

Each workload runs three ways in the same run, on the same sockets pattern (PUSH -> PULL):
  tidal    tidal.core.channels push/pull with protocol messages (msgspec header, zero-copy frames)
  pickle   raw pyzmq send_pyobj / recv_pyobj of the same content (a dict of numpy arrays)
  zerocopy raw pyzmq multipart: a hand-packed header frame + the raw buffers, copy=False both ways

Throughput is measured by the receiver, from its first message to its last, median of K trials.
Prints a table and one JSON line with the ratios (goals: small >= 2x pickle, large >= 0.9x zerocopy).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import statistics
import struct
import sys
import time

import numpy as np
import zmq

from tidal.core.arrays import Array
from tidal.core.channels import pull, push
from tidal.core.protocol import Metrics, Trajectory

MiB = 1024 * 1024
LARGE_BYTES = 64 * MiB


def small_content(rng: np.random.Generator) -> dict:
    return dict(
        id="traj-000001",
        group_id="group-0001",
        sample_index=3,
        task="arith",
        prompt_ids=rng.integers(0, 32000, 32, dtype=np.int32),
        completion_ids=rng.integers(0, 32000, 64, dtype=np.int32),
        logprobs=-rng.random(64, dtype=np.float32),
        versions=np.full(64, 7, np.int32),
        reward=1.0,
        finish_reason="stop",
    )


def as_trajectory(c: dict) -> Trajectory:
    arrays = {k: Array.from_numpy(v) for k, v in c.items() if isinstance(v, np.ndarray)}
    return Trajectory(**{**c, **arrays})


# ----------------------------------------------------------------------------- receiver process


def receiver(mode: str, workload: str, n: int, conn) -> None:
    ctx = zmq.Context()
    if mode == "tidal":
        # the large workload's messages are over the default limit for control traffic: said here, as a
        # channel that takes them must
        ch = pull("tcp://127.0.0.1:*", context=ctx, hwm=10_000, max_bytes=LARGE_BYTES + MiB)
        conn.send(ch.endpoint)
        first = None
        for _ in range(n):
            msg = ch.recv(timeout=60)
            if first is None:
                first = time.perf_counter()
            if workload == "large":
                assert msg.histograms["w"].nbytes == LARGE_BYTES
        end = time.perf_counter()
        ch.close()
    else:
        sock = ctx.socket(zmq.PULL)
        sock.rcvhwm = 10_000
        sock.bind("tcp://127.0.0.1:*")
        conn.send(sock.last_endpoint.decode())
        sock.rcvtimeo = 60_000
        first = None
        for _ in range(n):
            if mode == "pickle":
                obj = sock.recv_pyobj()
                if workload == "large":
                    assert obj["w"].nbytes == LARGE_BYTES
            else:
                frames = sock.recv_multipart(copy=False)
                header = frames[0].bytes
                if workload == "small":
                    # decode the hand-packed header and view each array (what a real receiver must do)
                    n_p, n_c = struct.unpack_from("<II", header)
                    bufs = frames[1:]
                    np.frombuffer(bufs[0].buffer, np.int32, n_p)
                    np.frombuffer(bufs[1].buffer, np.int32, n_c)
                    np.frombuffer(bufs[2].buffer, np.float32, n_c)
                    np.frombuffer(bufs[3].buffer, np.int32, n_c)
                else:
                    assert len(frames[1].buffer) == LARGE_BYTES
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        sock.close(linger=0)
    conn.send(end - first)
    ctx.term()


# ----------------------------------------------------------------------------- sender side


def run_once(mode: str, workload: str, n: int) -> float:
    """Seconds the receiver needed for messages 2..n (the first one starts its clock)."""
    mpctx = mp.get_context("spawn")
    parent, child = mpctx.Pipe()
    proc = mpctx.Process(target=receiver, args=(mode, workload, n, child), daemon=True)
    proc.start()
    try:
        endpoint = parent.recv()
        rng = np.random.default_rng(0)
        ctx = zmq.Context()
        if workload == "small":
            content = small_content(rng)
            traj = as_trajectory(content)
        else:
            payload = rng.standard_normal(LARGE_BYTES // 4, dtype=np.float32)
            metrics = Metrics(source="bench", step=0, time=0.0, scalars={}, histograms={"w": Array.from_numpy(payload)})
        if mode == "tidal":
            ch = push(endpoint, context=ctx, hwm=10_000)
            msg = traj if workload == "small" else metrics
            for _ in range(n):
                ch.send(msg)
            ch.close(linger=60)
        else:
            sock = ctx.socket(zmq.PUSH)
            sock.sndhwm = 10_000
            sock.connect(endpoint)
            for _ in range(n):
                if mode == "pickle":
                    sock.send_pyobj(content if workload == "small" else {"w": payload}, protocol=pickle.HIGHEST_PROTOCOL)
                elif workload == "small":
                    c = content
                    header = struct.pack("<II", 32, 64) + c["id"].encode() + c["group_id"].encode()
                    sock.send_multipart(
                        [header, c["prompt_ids"], c["completion_ids"], c["logprobs"], c["versions"]], copy=False
                    )
                else:
                    sock.send_multipart([struct.pack("<Q", LARGE_BYTES), payload], copy=False)
            sock.close(linger=60_000)
        elapsed = parent.recv() if parent.poll(120) else float("nan")
        ctx.term()
        return elapsed
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def measure(modes: list[str], workload: str, n: int, trials: int) -> dict[str, float]:
    """Median throughput per mode in units per second (messages/s or bytes/s). Trials of the modes
    are interleaved so that a slow patch of this shared machine hits every mode alike."""
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(trials):
        for mode in modes:
            elapsed = run_once(mode, workload, n)
            count = n - 1  # the receiver's clock starts at the first message
            rates[mode].append(count / elapsed if workload == "small" else count * LARGE_BYTES / elapsed)
    return {m: statistics.median(r) for m, r in rates.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=100_000, help="messages per small-message trial")
    ap.add_argument("--large", type=int, default=24, help="64 MiB payloads per large-message trial")
    ap.add_argument("--trials", type=int, default=5, help="trials per cell (median reported)")
    args = ap.parse_args(argv)
    if min(args.small, args.large) < 2:
        ap.error("--small and --large need at least 2 messages (the receiver's clock starts at the first)")

    modes = ["tidal", "pickle", "zerocopy"]
    results: dict[str, dict[str, float]] = {"small": {}, "large": {}}
    for workload, n in (("small", args.small), ("large", args.large)):
        results[workload] = measure(modes, workload, n, args.trials)

    print(f"{'workload':<26}{'tidal':>14}{'pickle':>14}{'zerocopy':>14}{'tidal/pickle':>14}{'tidal/zerocopy':>16}")
    s, lg = results["small"], results["large"]
    print(f"{'small ~1 KiB (msg/s)':<26}{s['tidal']:>14,.0f}{s['pickle']:>14,.0f}{s['zerocopy']:>14,.0f}"
          f"{s['tidal'] / s['pickle']:>14.2f}{s['tidal'] / s['zerocopy']:>16.2f}")
    print(f"{'large 64 MiB (GB/s)':<26}{lg['tidal'] / 1e9:>14.2f}{lg['pickle'] / 1e9:>14.2f}{lg['zerocopy'] / 1e9:>14.2f}"
          f"{lg['tidal'] / lg['pickle']:>14.2f}{lg['tidal'] / lg['zerocopy']:>16.2f}")
    summary = {
        "bench": "transport",
        "small_msgs_per_s": {k: round(v) for k, v in s.items()},
        "large_gb_per_s": {k: round(v / 1e9, 3) for k, v in lg.items()},
        "small_vs_pickle": round(s["tidal"] / s["pickle"], 3),
        "small_vs_zerocopy": round(s["tidal"] / s["zerocopy"], 3),
        "large_vs_zerocopy": round(lg["tidal"] / lg["zerocopy"], 3),
        "large_vs_pickle": round(lg["tidal"] / lg["pickle"], 3),
        "goals": {"small_vs_pickle": 2.0, "large_vs_zerocopy": 0.9},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
