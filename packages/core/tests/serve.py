"""A real Tidal ROUTER server process for tests: answers every valid request with an Ack naming its
type, lets the channel answer bad ones with Error, and counts both. Stops on Control(stop, reason="bye")
or when its parent goes away. Prints its endpoint on the first line of stdout."""

from __future__ import annotations

import argparse
import os
import sys

from tidal.core.channels import router
from tidal.core.errors import ChannelTimeout, ProtocolError
from tidal.core.protocol import Ack, Control
from tidal.core.security import CurveServer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--curve-secret")
    ap.add_argument("--authorized")
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:*")
    args = ap.parse_args()
    curve = CurveServer.from_files(args.curve_secret, args.authorized) if args.curve_secret else None
    parent = os.getppid()
    ok = errors = 0
    with router(args.endpoint, curve=curve, linger=1.0) as ch:
        print(ch.endpoint, flush=True)
        while True:
            try:
                peer, msg = ch.recv(timeout=0.5)
            except ChannelTimeout:
                if os.getppid() != parent:
                    return 1
                continue
            except ProtocolError:
                errors += 1
                continue
            ok += 1
            if type(msg) is Control and msg.command == "stop" and msg.reason == "bye":
                ch.send(peer, Ack(kind="stats", ids=[str(ok), str(errors)]))
                return 0
            ch.send(peer, Ack(kind="echo", ids=[type(msg).__name__]))


if __name__ == "__main__":
    sys.exit(main())
