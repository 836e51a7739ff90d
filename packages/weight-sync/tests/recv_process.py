"""A generator-side test process: receives WeightsAvailable announcements over a PULL socket, applies
each through a WeightReceiver, and writes what it now holds to OUT/v<version>.safetensors (or the
error to OUT/v<version>.error). Prints its endpoint first; stops on Control(stop)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

from tidal.core.channels import pull
from tidal.core.errors import ChannelTimeout
from tidal.core.protocol import Control, WeightsAvailable
from tidal.weight_sync import WeightReceiver, WeightSyncError


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("transport")
    ap.add_argument("out")
    ap.add_argument("--options", default="{}", help="JSON keyword options of the receiver transport")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parent = os.getppid()
    held: dict = {}
    with pull("tcp://127.0.0.1:*") as inbox:
        print(inbox.endpoint, flush=True)  # before the transport: a collective one blocks until all join
        receiver = WeightReceiver(args.transport, **json.loads(args.options))
        try:
            while True:
                try:
                    msg = inbox.recv(timeout=0.5)
                except ChannelTimeout:
                    if os.getppid() != parent:
                        return 1
                    continue
                if type(msg) is Control and msg.command == "stop":
                    return 0
                if type(msg) is not WeightsAvailable:
                    continue

                def apply(tensors):
                    held.update({n: t.to("cpu", copy=True) for n, t in tensors})  # GPU tensors too (cuda_ipc)

                try:
                    receiver.receive(msg, apply)
                    save_file(dict(held), str(out / f"v{msg.version}.safetensors"))
                except WeightSyncError as e:
                    (out / f"v{msg.version}.error").write_text(str(e))
                # written whole, then renamed: the test polls for the file and reads it at once
                tmp = out / f"v{msg.version}.done.tmp"
                tmp.write_text(json.dumps({"held": receiver.version}))
                tmp.rename(out / f"v{msg.version}.done")
        finally:  # a collective transport's thread is stopped, not left behind at exit
            receiver.close()


if __name__ == "__main__":
    sys.exit(main())
