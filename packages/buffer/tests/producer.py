"""A test producer process: pushes COUNT trajectories in groups of G through AckedPusher, resending until
each is acknowledged, and appends every acknowledged id to ACKED_FILE as soon as its Ack arrives.
`--unit group` sends each group of G as one TrajectoryGroup message (COUNT a multiple of G)."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from tidal.core.arrays import Array
from tidal.core.protocol import Trajectory, TrajectoryGroup
from tidal.core.reliable import AckedPusher


def make(name: str, i: int, group_size: int, tokens: int, rng) -> Trajectory:
    n = int(rng.integers(1, tokens + 1))
    return Trajectory(
        id=f"{name}-{i}",
        group_id=f"{name}-g{i // group_size}",
        sample_index=i % group_size,
        task="test",
        prompt_ids=Array.from_numpy(rng.integers(0, 100, 8, dtype=np.int32)),
        completion_ids=Array.from_numpy(rng.integers(0, 100, n, dtype=np.int32)),
        logprobs=Array.from_numpy(-rng.random(n, dtype=np.float32)),
        versions=Array.from_numpy(np.zeros(n, np.int32)),
        reward=float(rng.integers(0, 2)),
        finish_reason="stop",
        source=name,
        group_size=group_size,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ingest")
    ap.add_argument("publish")
    ap.add_argument("name")
    ap.add_argument("count", type=int)
    ap.add_argument("group_size", type=int)
    ap.add_argument("acked_file")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--resend-after", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--malformed-every", type=int, default=0)
    ap.add_argument("--unit", choices=["trajectory", "group"], default="trajectory")
    args = ap.parse_args()
    rng = np.random.default_rng(abs(hash(args.name)) % 2**32)
    deadline = time.monotonic() + args.timeout
    acked = open(args.acked_file, "a")

    def record(ids: list[str]) -> None:
        acked.write("".join(f"{i}\n" for i in ids))
        acked.flush()

    with acked, AckedPusher(
        args.ingest, args.publish, args.name, window=args.window, resend_after=args.resend_after, on_ack=record
    ) as out:
        members: list[Trajectory] = []
        for i in range(args.count):
            if args.malformed_every and i % args.malformed_every == 0:
                out._push.socket.send_multipart([b"\xd7T\x01\x00garbage"])  # a broken peer's message
            t = make(args.name, i, args.group_size, args.tokens, rng)
            if args.unit == "group":
                members.append(t)
                if len(members) < args.group_size:
                    continue
                t, members = TrajectoryGroup(id=t.group_id, trajectories=members, source=args.name), []
            out.send(t, timeout=max(1.0, deadline - time.monotonic()))
            out.poll(0)
        while out.pending:
            if time.monotonic() > deadline:
                print(f"{len(out.pending)} unacknowledged at the deadline", file=sys.stderr)
                return 1
            out.poll(0.1)
        if out.rejected:
            print(f"rejected: {dict(list(out.rejected.items())[:5])}", file=sys.stderr)
            return 2
        print(f"acked={out.acked} resent={out.resent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
