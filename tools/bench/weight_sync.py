"""Weight-sync benchmark: each transport end to end (sender.send -> receiver verified and applied, two
processes), beside baselines measured in the same run.

    uv run python tools/bench/weight_sync.py [--big-gib 1.0] [--small 3000] [--trials 3]

States:
  big    ~1 GiB in ~300 fp32 tensors: bandwidth, against a plain memcpy of the same bytes, and (zmq,
         torch_dist) against the raw stream below
  small  ~3,000 tensors of 4 KiB-1 MiB (norms, biases, LoRA adapters): against the raw stream, and
         against per-parameter sending over the same transport and code (one bucket per tensor: zmq one
         request/reply each, all in flight at once ("pipelined") or one at a time ("serial", the naive
         loop); gloo one broadcast each)
  delta  a bf16 model after one AdamW step with lr 1e-6: delta payload as a fraction of dense
Raw stream: the same total bytes, already in one contiguous buffer, moved once over the same kind of
channel between the same two processes, with no packing, checksum or unpacking: zmq, one request and a
one-frame zero-copy pyzmq reply (ROUTER in the sender, DEALER in the receiver, tcp loopback, as the
transport); torch_dist, one gloo broadcast of one flat uint8 tensor in a world of the same two ranks
(the receiver's tensor allocated once, as the transport reuses its buffers). Raw and bucketed trials
alternate, so a load change on the machine hits both; a ratio is the median of the per-trial ratios.
After the timed trials the receiver hashes what it last got both ways: the bench fails unless the raw
bytes, the received state and the sender's state are bit-identical.
Verified floor (torch_dist): the raw gloo stream again, in bucket-sized pieces, each checksummed with
the transport's algorithm by the sender before it goes out and by the receiver as it lands (the next
piece already on the wire): the least a transfer that verifies every byte costs on this host, with no
packing, unpacking or protocol; printed beside the goal, which it does not change.
Goals (PASS/MISS printed): bucketed <= 1.25x raw for the small state (zmq and gloo); shm >= 0.5x
memcpy (big); delta <= 5 %. The per-parameter speed-up is printed for reference (no goal: on a
bandwidth-bound host it measures the bytes, not the per-call overhead).
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
import xxhash
import zmq

from tidal.core.protocol import WeightsAvailable
from tidal.core.testing import free_port
from tidal.weight_sync import WeightReceiver, WeightSender, delta
from tidal.weight_sync.buckets import checksum, make_buckets

GOAL_VS_RAW = 1.25
RAW_TRANSPORTS = ("zmq", "torch_dist")
TIMEOUT_S = 120.0  # every wait for the other process


def big_state(gib: float) -> dict[str, torch.Tensor]:
    n = 300
    per = int(gib * 2**30 / 4 / n)
    return {f"layer{i}.weight": torch.full((per,), float(i)) for i in range(n)}


def small_state(n: int, lo: int = 4096, hi: int = 2**20) -> dict[str, torch.Tensor]:
    """`n` fp32 tensors of `lo`..`hi` bytes (log-uniform), each with its own values."""
    rng = np.random.default_rng(0)
    sizes = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(int) // 4
    return {f"p{i}": torch.full((max(1, int(s)),), 0.5 + i) for i, s in enumerate(sizes)}


def flat(state: dict[str, torch.Tensor]) -> np.ndarray:
    """The state's bytes back to back, in its order: what the raw stream moves."""
    return np.concatenate([t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in state.values()])


def state_digest(named) -> str:
    """xxh3-128 of the tensors' bytes back to back, in the given order (the sender's manifest order,
    which for a one-dtype state is the state's order, hence comparable with `flat`)."""
    h = xxhash.xxh3_128()
    for _, t in named:
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


# ----------------------------------------------------------------------------- receiver process


class RawEnd:
    """The receiver's end of the raw stream."""

    def __init__(self, kind: str, where: str, nbytes: int) -> None:
        self.kind, self.nbytes = kind, nbytes
        if kind == "zmq":
            self.sock = zmq.Context.instance().socket(zmq.DEALER)
            self.sock.linger = 0
            self.sock.connect(where)
        else:
            self.pg = raw_group(where, 1)
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.last: object = None

    def take(self) -> None:
        if self.kind == "zmq":
            self.sock.send(b"go")
            if not self.sock.poll(int(TIMEOUT_S * 1000)):
                raise TimeoutError(f"raw zmq stream: nothing within {TIMEOUT_S} s")
            frame = self.sock.recv(copy=False)
            if len(frame) != self.nbytes:
                raise ValueError(f"raw zmq stream: {len(frame)} bytes, expected {self.nbytes}")
            self.last = frame
        else:
            broadcast(self.pg, self.buf)
            self.last = self.buf

    def take_verified(self, chunk: int) -> list[int]:
        """The raw gloo stream in `chunk`-byte pieces, each checksummed as it lands while the next one
        arrives (its receive already posted): what any verified transfer here must at least cost, with
        no packing, unpacking or protocol. The pieces' checksums, for the sender to compare."""
        parts = pieces(self.buf, chunk)
        works = [post(self.pg, parts[0])]
        sums = []
        for k, part in enumerate(parts):
            if k + 1 < len(parts):
                works.append(post(self.pg, parts[k + 1]))
            works[k].wait()
            sums.append(checksum(part.numpy()))
        self.last = self.buf
        return sums

    def digest(self) -> str:
        data = self.last.buffer if self.kind == "zmq" else self.buf.numpy()
        return xxhash.xxh3_128(data).hexdigest()

    def close(self) -> None:
        if self.kind == "zmq":
            self.sock.close(0)


def raw_group(address: str, rank: int):
    import datetime

    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore(host, int(port), 2, rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def broadcast(pg, t: torch.Tensor) -> None:
    post(pg, t).wait()


def post(pg, t: torch.Tensor):
    """Start a broadcast of `t` from rank 0; its work, to wait on."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([t], opts)


def pieces(t: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    return [t[i : i + chunk] for i in range(0, t.numel(), chunk)]


def receiver_main(transport: str, options: dict, raw: tuple | None, conn) -> None:
    torch.set_num_threads(1)
    r = WeightReceiver(transport, **options)
    raw_end = RawEnd(*raw) if raw else None
    conn.send_bytes(b"ready")
    got = ""
    while True:
        cmd = conn.recv_bytes()
        if cmd == b"stop":
            break
        if cmd == b"raw":
            raw_end.take()
            conn.send_bytes(b"done")
        elif cmd.startswith(b"rawv:"):  # the verified floor, in pieces of the given size
            sums = raw_end.take_verified(int(cmd[5:]))
            conn.send_bytes(b"done")
            conn.send_bytes(json.dumps(sums).encode())
        elif cmd == b"digest":  # outside the timing: what the last raw take and the last version held
            conn.send_bytes(json.dumps({"raw": raw_end.digest() if raw_end else "", "state": got}).encode())
        else:
            check = cmd.startswith(b"check:")
            ann = msgspec.msgpack.decode(cmd.split(b":", 1)[1], type=WeightsAvailable)

            def apply(named, check=check):
                nonlocal got
                if check:  # the tensors view the receiver's buffers: hash them while they are valid
                    got = state_digest(named)

            r.receive(ann, apply)
            conn.send_bytes(b"done")
    if raw_end:
        raw_end.close()
    r.close()


def start(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, child), daemon=True)
    p.start()
    return p, parent


def wait_done(conn) -> None:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"the receiver did not finish within {TIMEOUT_S} s")
    msg = conn.recv_bytes()
    if msg != b"done":
        raise RuntimeError(f"receiver: {msg!r}")


class RawSource:
    """The sender's end of the raw stream, in the bench process (as the transport's sender is)."""

    def __init__(self, kind: str, data: np.ndarray) -> None:
        self.kind, self.data = kind, data
        if kind == "zmq":
            self.sock = zmq.Context.instance().socket(zmq.ROUTER)
            self.sock.linger = 0
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.where = f"tcp://127.0.0.1:{port}"
        else:
            self.where = f"127.0.0.1:{free_port()}"
            self.pg = None
            self.tensor = torch.from_numpy(data)

    def connect(self) -> None:  # gloo: the store's rendezvous needs both ranks
        if self.kind == "torch_dist":
            self.pg = raw_group(self.where, 0)

    def give(self) -> None:
        if self.kind == "zmq":
            if not self.sock.poll(int(TIMEOUT_S * 1000)):
                raise TimeoutError("raw zmq stream: no request")
            peer, _ = self.sock.recv_multipart()
            self.sock.send_multipart([peer, self.data], copy=False)
        else:
            broadcast(self.pg, self.tensor)

    def give_verified(self, chunk: int) -> list[int]:
        """`give` for `RawEnd.take_verified`: each piece checksummed, then posted, while the piece
        before it is still on the wire (two in flight at most, as the transport's broadcasts)."""
        sums, flight = [], []
        for part in pieces(self.tensor, chunk):
            sums.append(checksum(part.numpy()))
            flight.append(post(self.pg, part))
            if len(flight) > 1:
                flight.pop(0).wait()
        for work in flight:
            work.wait()
        return sums

    def close(self) -> None:
        if self.kind == "zmq":
            self.sock.close(0)


# ----------------------------------------------------------------------------- measurements


def endpoint_options(transport: str, receiver_options: dict) -> tuple[dict, dict]:
    """The sender's and the receiver's transport options for a two-process run."""
    if transport == "fs":
        return {"root": tempfile.mkdtemp(prefix="tidal-bench-ws-"), "fsync": False}, dict(receiver_options)
    if transport == "torch_dist":
        address = f"127.0.0.1:{free_port()}"
        return ({"address": address, "world_size": 2},
                {"address": address, "rank": 1, "world_size": 2, **receiver_options})
    return {}, dict(receiver_options)


def time_transport(transport: str, state: dict, trials: int, bucket_bytes: int, raw: bool = False,
                   **receiver_options) -> dict:
    """Median seconds from send() to the receiver's verified apply (`s`), the median of the sender's
    breakdown (send_s: send() itself; pack_s: packing and checksums; stage_s: handing buckets to the
    transport; pack_s + stage_s > send_s where they overlap). With `raw`: the raw stream of the same
    bytes between the same two processes (`raw_s`), trials alternating, `vs_raw` the median of the
    per-trial ratios, and `identical`: raw bytes, received state and sent state all hash the same."""
    sopts, ropts = endpoint_options(transport, receiver_options)
    source = RawSource(transport, flat(state)) if raw else None
    proc, conn = start(receiver_main, transport, ropts,
                       (transport, source.where, source.data.size) if source else None)
    try:
        sender = WeightSender(transport, bucket_bytes=bucket_bytes, **sopts)  # torch_dist joins in a thread
        if source:
            source.connect()
        if not conn.poll(TIMEOUT_S) or conn.recv_bytes() != b"ready":
            raise RuntimeError("the receiver did not start")
        times, raw_times, floor_times, stats = [], [], [], []
        verified = source is not None and transport == "torch_dist"
        warmup = 3  # steady state: every reused buffer (3 sender generations, 2 receiver sets) faulted in
        for v in range(trials + warmup):
            raw_t = time_raw(conn, source) if source else 0.0
            floor_t = time_floor(conn, source, bucket_bytes) if verified else 0.0
            t0 = time.perf_counter()
            ann = sender.send(state, v)
            # msgpack, as announcements travel on Tidal's wire; the last version is hashed where it lands
            conn.send_bytes((b"check:" if v == trials + warmup - 1 else b"ann:") + msgspec.msgpack.encode(ann))
            wait_done(conn)
            if v >= warmup:
                times.append(time.perf_counter() - t0)
                stats.append(dict(sender.last_stats))
                raw_times.append(raw_t)
                floor_times.append(floor_t)
        conn.send_bytes(b"digest")
        got = json.loads(conn.recv_bytes())
        sent = state_digest((s.name, state[s.name]) for s in ann.manifest)
        conn.send_bytes(b"stop")
        proc.join(30)
        sender.close()
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        if source:
            source.close()
    keys = ("send_s", "pack_s", "stage_s")
    out = {"s": round(statistics.median(times), 4),
           **{k: round(statistics.median(s.get(f"weights/{k}", 0.0) for s in stats), 4) for k in keys}}
    if source:
        out["raw_s"] = round(statistics.median(raw_times), 4)
        out["vs_raw"] = round(statistics.median(t / r for t, r in zip(times, raw_times, strict=True)), 3)
        out["identical"] = got["raw"] == got["state"] == sent == xxhash.xxh3_128(source.data).hexdigest()
        if verified:
            out["floor_s"] = round(statistics.median(floor_times), 4)
            out["floor_vs_raw"] = round(statistics.median(f / r for f, r in zip(floor_times, raw_times, strict=True)), 3)
    else:
        out["identical"] = got["state"] == sent
    if not out["identical"]:
        raise AssertionError(f"{transport}: bytes differ: sent {sent}, received {got}")
    return out


def time_raw(conn, source: RawSource) -> float:
    """Seconds for one raw stream of the state's bytes, until the receiver has them."""
    t0 = time.perf_counter()
    conn.send_bytes(b"raw")
    source.give()
    wait_done(conn)
    return time.perf_counter() - t0


def time_floor(conn, source: RawSource, chunk: int) -> float:
    """Seconds for one verified raw stream (`RawSource.give_verified`), until the receiver has checked it;
    raises unless the receiver's checksums are the sender's."""
    t0 = time.perf_counter()
    conn.send_bytes(b"rawv:%d" % chunk)
    sums = source.give_verified(chunk)
    wait_done(conn)
    took = time.perf_counter() - t0
    if json.loads(conn.recv_bytes()) != sums:
        raise AssertionError("verified raw stream: the receiver's checksums differ from the sender's")
    return took


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


def small_table(n_small: int, trials: int, bucket: int, bucket_mib: int) -> dict:
    """The small state over zmq and gloo: bucketed against the raw stream, the per-parameter baseline,
    and (gloo) the verified floor; printed as a table, returned for the JSON line."""
    small = small_state(n_small)
    sbytes = sum(t.numel() * 4 for t in small.values())
    print(f"\nsmall state: {len(small)} tensors, {sbytes / 2**20:.0f} MiB; goal: bucketed <= {GOAL_VS_RAW}x raw")
    print(f"{'transport':<22}{'raw s':>8}{'bucketed s':>12}{'vs raw':>8}{'goal':>6}{'per-param s':>13}{'speed-up':>10}"
          f"{'send s':>8}{'pack s':>8}")
    out: dict = {"tensors": len(small), "bytes": sbytes}
    bucketed: dict[str, dict] = {}
    for label, tr, opts in (("zmq (pipelined)", "zmq", {}), ("zmq (serial)", "zmq", {"window": 1}),
                            ("torch_dist (gloo)", "torch_dist", {})):
        # the bucketed sync (all requests in flight) is measured once per transport; the rows differ in
        # how the per-parameter baseline requests its tensors
        if tr not in bucketed:
            bucketed[tr] = time_transport(tr, small, trials, bucket, raw=True)
        b = bucketed[tr]
        n = time_transport(tr, small, trials, 1, **opts)["s"]  # every tensor in a bucket of its own
        ok = b["vs_raw"] <= GOAL_VS_RAW
        out[label] = {"raw_s": b["raw_s"], "bucketed_s": b["s"], "vs_raw": b["vs_raw"],
                      "goal": verdict(ok), "per_param_s": round(n, 3), "speedup": round(n / b["s"], 2),
                      "send_s": b["send_s"], "pack_s": b["pack_s"], "identical": b["identical"]}
        print(f"{label:<22}{b['raw_s']:>8.3f}{b['s']:>12.3f}{b['vs_raw']:>8.2f}{verdict(ok):>6}{n:>13.3f}"
              f"{n / b['s']:>10.2f}{b['send_s']:>8.3f}{b['pack_s']:>8.3f}")
        if "floor_s" in b:
            out[label].update(floor_s=b["floor_s"], floor_vs_raw=b["floor_vs_raw"],
                              vs_floor=round(b["s"] / b["floor_s"], 3))
            print(f"{'  verified floor':<22}{'':>8}{b['floor_s']:>12.3f}{b['floor_vs_raw']:>8.2f}"
                  f"   (the raw stream in {bucket_mib} MiB pieces, each checksummed on both ends as the "
                  f"transport does; bucketed = {b['s'] / b['floor_s']:.2f}x this)")
    return out


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-gib", type=float, default=1.0)
    ap.add_argument("--small", type=int, default=3000)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=32, help="bucket size (MiB): the pipelining granularity between packing, transfer and checking")
    ap.add_argument("--skip-big", action="store_true", help="only the small state (and delta)")
    args = ap.parse_args(argv)
    results: dict = {}
    bucket = args.bucket_mib * 2**20

    if not args.skip_big:
        big = big_state(args.big_gib)
        nbytes = sum(t.numel() * 4 for t in big.values())
        memcpy = time_memcpy(big, args.trials)
        results["big"] = {"bytes": nbytes, "memcpy_s": memcpy}
        print(f"big state: {nbytes / 2**30:.2f} GiB in {len(big)} tensors; memcpy {nbytes / memcpy / 1e9:.2f} GB/s")
        print(f"{'transport':<12}{'seconds':>10}{'GB/s':>8}{'vs memcpy':>11}{'raw s':>9}{'vs raw':>8}"
              f"{'send s':>9}{'pack s':>9}{'stage s':>9}")
        for tr in ("shm", "zmq", "torch_dist", "fs"):
            r = time_transport(tr, big, args.trials, bucket, raw=tr in RAW_TRANSPORTS)
            s = r["s"]
            results["big"][tr] = {**r, "vs_memcpy": round(memcpy / s, 3)}
            raw_cols = f"{r['raw_s']:>9.3f}{r['vs_raw']:>8.2f}" if "raw_s" in r else f"{'-':>9}{'-':>8}"
            print(f"{tr:<12}{s:>10.3f}{nbytes / s / 1e9:>8.2f}{memcpy / s:>11.3f}{raw_cols}"
                  f"{r['send_s']:>9.3f}{r['pack_s']:>9.3f}{r['stage_s']:>9.3f}")
        del big

    results["small"] = small_table(args.small, args.trials, bucket, args.bucket_mib)

    frac = delta_fraction()
    results["delta_fraction_lr1e-6_bf16"] = round(frac, 4)
    print(f"\ndelta payload after one AdamW step (lr 1e-6, bf16): {100 * frac:.2f} % of dense "
          f"({verdict(frac <= 0.05)})")
    if "big" in results:
        print(f"shm vs memcpy (big): {results['big']['shm']['vs_memcpy']:.2f} "
              f"({verdict(results['big']['shm']['vs_memcpy'] >= 0.5)})")
    print(json.dumps({"bench": "weight_sync", **results,
                      "goals": {"shm_vs_memcpy": 0.5, "small_vs_raw": GOAL_VS_RAW, "delta_fraction": 0.05}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
