"""Weight-sync benchmark: each transport end to end (sender.send -> receiver verified and applied, two
processes), beside baselines measured in the same run.

    uv run python tools/bench/weight_sync.py [--big-gib 1.0] [--small 3000] [--trials 2]

States:
  big    ~1 GiB in ~300 fp32 tensors — bandwidth, against a plain memcpy of the same bytes
  small  ~3,000 tensors of 4 KiB-1 MiB (norms, biases, LoRA adapters) — per-call overhead, against
         per-parameter sending over the same transport and code (one bucket per tensor: zmq one
         request/reply each, all in flight at once ("pipelined") or one at a time ("serial", the naive
         loop); gloo one broadcast each)
  delta  a bf16 model after one AdamW step with lr 1e-6: delta payload as a fraction of dense
Goals: shm >= 0.5x memcpy (big); bucketed >= 5x per-parameter (small, zmq and gloo); delta <= 5 %.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time

import msgspec
import numpy as np
import torch

from tidal.core.protocol import WeightsAvailable
from tidal.core.testing import free_port
from tidal.weight_sync import WeightReceiver, WeightSender, delta
from tidal.weight_sync.buckets import make_buckets


def big_state(gib: float) -> dict[str, torch.Tensor]:
    n = 300
    per = int(gib * 2**30 / 4 / n)
    return {f"layer{i}.weight": torch.full((per,), float(i)) for i in range(n)}


def small_state(n: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    sizes = np.exp(rng.uniform(np.log(4096), np.log(2**20), n)).astype(int) // 4
    return {f"p{i}": torch.full((int(s),), 0.5) for i, s in enumerate(sizes)}


# ----------------------------------------------------------------------------- receiver processes


def receiver_main(transport: str, options: dict, conn) -> None:
    torch.set_num_threads(1)
    r = WeightReceiver(transport, **options)
    conn.send_bytes(b"ready")
    while True:
        raw = conn.recv_bytes()
        if raw == b"stop":
            break
        ann = msgspec.json.decode(raw, type=WeightsAvailable)
        r.receive(ann, lambda tensors: None)
        conn.send_bytes(b"done")
    r.close()


def start(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, child), daemon=True)
    p.start()
    return p, parent


# ----------------------------------------------------------------------------- measurements


def time_transport(transport: str, state: dict, trials: int, bucket_bytes: int, **receiver_options) -> tuple[float, dict]:
    """Median seconds from send() to the receiver's verified apply, and the median of the sender's
    breakdown (send_s: send() itself; pack_s: packing and checksums; stage_s: handing buckets to the
    transport; pack_s + stage_s > send_s where they overlap)."""
    sopts: dict = {}
    ropts: dict = dict(receiver_options)
    if transport == "fs":
        sopts = {"root": tempfile.mkdtemp(prefix="tidal-bench-ws-"), "fsync": False}
    if transport == "torch_dist":
        address = f"127.0.0.1:{free_port()}"
        sopts = {"address": address, "world_size": 2}
        ropts = {"address": address, "rank": 1, "world_size": 2, **ropts}
    proc, conn = start(receiver_main, transport, ropts)
    sender = WeightSender(transport, bucket_bytes=bucket_bytes, **sopts)
    assert conn.recv_bytes() == b"ready"
    times, stats = [], []
    warmup = 3  # steady state: every reused buffer (3 sender generations, 2 receiver sets) faulted in
    for v in range(trials + warmup):
        t0 = time.perf_counter()
        ann = sender.send(state, v)
        conn.send_bytes(msgspec.json.encode(ann))
        assert conn.recv_bytes() == b"done"
        if v >= warmup:
            times.append(time.perf_counter() - t0)
            stats.append(dict(sender.last_stats))
    conn.send_bytes(b"stop")
    proc.join(30)
    sender.close()
    keys = ("send_s", "pack_s", "stage_s")
    return statistics.median(times), {k: round(statistics.median(s.get(f"weights/{k}", 0.0) for s in stats), 3) for k in keys}


def time_memcpy(state: dict, trials: int) -> float:
    src = [t.view(torch.uint8).numpy() for t in state.values()]
    dst = [np.empty_like(s) for s in src]
    times = []
    for _ in range(trials + 1):
        t0 = time.perf_counter()
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def delta_fraction(params_m: int = 20) -> float:
    torch.manual_seed(0)
    width = 1024
    layers = max(1, params_m * 10**6 // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(torch.bfloat16)
    before = list(make_buckets(((k, v.clone()) for k, v in model.state_dict().items()), 64 * 2**20))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model(torch.randn(8, width, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    after = list(make_buckets(model.state_dict().items(), 64 * 2**20))
    sent = dense = 0
    for a, b in zip(sorted(after, key=lambda x: x.index), sorted(before, key=lambda x: x.index), strict=True):
        enc = delta.encode(a.data, b.data, 2)
        sent += a.nbytes if enc is None else len(enc)
        dense += a.nbytes
    return sent / dense


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-gib", type=float, default=1.0)
    ap.add_argument("--small", type=int, default=3000)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--bucket-mib", type=int, default=32, help="bucket size (MiB): the pipelining granularity between packing, transfer and checking")
    args = ap.parse_args(argv)
    results: dict = {}

    big = big_state(args.big_gib)
    nbytes = sum(t.numel() * 4 for t in big.values())
    memcpy = time_memcpy(big, args.trials)
    results["big"] = {"bytes": nbytes, "memcpy_s": memcpy}
    print(f"big state: {nbytes / 2**30:.2f} GiB in {len(big)} tensors; memcpy {nbytes / memcpy / 1e9:.2f} GB/s")
    print(f"{'transport':<12}{'seconds':>10}{'GB/s':>8}{'vs memcpy':>11}{'send s':>9}{'pack s':>9}{'stage s':>9}")
    for tr in ("shm", "zmq", "torch_dist", "fs"):
        s, st = time_transport(tr, big, args.trials, args.bucket_mib * 2**20)
        results["big"][tr] = {"s": round(s, 3), "vs_memcpy": round(memcpy / s, 3), **st}
        print(f"{tr:<12}{s:>10.3f}{nbytes / s / 1e9:>8.2f}{memcpy / s:>11.3f}"
              f"{st['send_s']:>9.3f}{st['pack_s']:>9.3f}{st['stage_s']:>9.3f}")
    del big

    small = small_state(args.small)
    sbytes = sum(t.numel() * 4 for t in small.values())
    print(f"\nsmall state: {len(small)} tensors, {sbytes / 2**20:.0f} MiB")
    print(f"{'transport':<22}{'bucketed s':>12}{'per-param s':>13}{'speed-up':>10}")
    results["small"] = {"tensors": len(small), "bytes": sbytes}
    for label, tr, opts in (("zmq (pipelined)", "zmq", {}), ("zmq (serial)", "zmq", {"window": 1}),
                            ("torch_dist (gloo)", "torch_dist", {})):
        b, _ = time_transport(tr, small, args.trials, args.bucket_mib * 2**20)
        n, _ = time_transport(tr, small, args.trials, 1, **opts)  # every tensor in a bucket of its own
        results["small"][label] = {"bucketed_s": round(b, 3), "per_param_s": round(n, 3), "speedup": round(n / b, 2)}
        print(f"{label:<22}{b:>12.3f}{n:>13.3f}{n / b:>10.2f}")

    frac = delta_fraction()
    results["delta_fraction_lr1e-6_bf16"] = round(frac, 4)
    print(f"\ndelta payload after one AdamW step (lr 1e-6, bf16): {100 * frac:.2f} % of dense")
    print(json.dumps({"bench": "weight_sync", **results,
                      "goals": {"shm_vs_memcpy": 0.5, "small_speedup": 5.0, "delta_fraction": 0.05}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
