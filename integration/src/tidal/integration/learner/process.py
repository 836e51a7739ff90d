"""The learner process: `python -m tidal.integration.learner`, one rank or several.

    python -m tidal.integration.learner --config learner.toml model="/models/tiny" backend.name="fsdp2" --nproc 2

`--nproc N` starts N ranks under torch.distributed (gloo on CPU, NCCL on GPU) on this machine; each builds
its `Learner` (build.py) and runs tidal-learner's `loop.run`. SIGTERM and SIGINT stop it at the next step, with the
exit checkpoint and export.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys

import torch.distributed as dist

from tidal.core.config import load_config, read_config
from tidal.core.process import role_main, setup_role_process
from tidal.integration.learner.build import build_learner
from tidal.integration.old_spellings import refuse_old_spellings
from tidal.learner import loop
from tidal.learner.config import LearnerConfig


def _spawn(nproc: int, argv: list[str]) -> int:
    """`nproc` learner ranks on this machine; the worst exit code. Not torchrun: its agent starts each
    rank in a session of its own, so the driver's kill of the learner's process group (kill -9 drills,
    a stalled run) would leave the ranks running, holding their ports (measured with torch 2.15); and
    a SIGTERM'd agent raises SignalException without the ranks' codes, while the driver needs 0 from a
    clean stop and 78 from a refused configuration. These ranks stay in our process group."""
    # The ranks' rendezvous store listens on loopback alone: a socket bound and listening here, handed to
    # rank 0 (TCPStore on its own listens on every interface). Listening from now on, the port is held.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = str(listener.getsockname()[1])
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env[STORE_FD_ENV] = str(listener.fileno()) if rank == 0 else "-"  # the others connect to it
        fds = (listener.fileno(),) if rank == 0 else ()
        procs.append(subprocess.Popen([sys.executable, "-m", "tidal.integration.learner", *argv], env=env,
                                      pass_fds=fds))
    listener.close()  # rank 0 holds its copy

    def forward(sig, _frame):
        for p in procs:
            p.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


STORE_FD_ENV = "TIDAL_STORE_FD"  # rank 0 of a `_spawn`: the listening socket its rendezvous store serves on


def _init_distributed(backend: str) -> None:
    """torch.distributed from the environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT). Ranks started by
    `_spawn` rendezvous through a store whose rank 0 serves on the loopback socket it was handed."""
    fd = os.environ.pop(STORE_FD_ENV, "")
    if fd == "":  # torchrun, Ray: the usual env:// rendezvous
        dist.init_process_group(backend)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(minutes=10), master_listen_fd=int(fd) if rank == 0 else None)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tidal-learner",
        description="Run the Tidal learner: batches from the buffer, a policy-gradient step per batch, "
                    "weights published to the generators.",
        epilog="Overrides use dotted TOML syntax, e.g. model=\"/models/tiny\" backend.name=\"fsdp2\" "
               "train.loss.name=\"gspo\" backend.options.optim.lr=1e-6 weights.transport.name=\"shm\"",
    )
    ap.add_argument("--config", help="TOML file with learner settings")
    ap.add_argument("--nproc", type=int, default=1, help="ranks to start on this machine (torch.distributed)")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value settings applied on top")
    ap.add_argument("--log-level", default=os.environ.get("TIDAL_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    raw = list(argv if argv is not None else sys.argv[1:])
    if args.nproc > 1 and "RANK" not in os.environ:
        rest = [a for i, a in enumerate(raw) if a != "--nproc" and not a.startswith("--nproc=")
                and not (i > 0 and raw[i - 1] == "--nproc")]
        return _spawn(args.nproc, rest)
    setup_role_process(args.log_level)  # `kill -USR1 PID` writes every thread's stack to the log
    # the learner's own settings are the recipe's [learner] section: its old spellings get the same message
    settings, source = read_config(args.config)
    refuse_old_spellings({"learner": settings}, [f"learner.{o}" for o in args.overrides], source)
    cfg = load_config(args.config, LearnerConfig, args.overrides)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _init_distributed("nccl" if cfg.device.startswith("cuda") else "gloo")
    learner = build_learner(cfg)
    signal.signal(signal.SIGTERM, lambda *_: learner.stop())
    signal.signal(signal.SIGINT, lambda *_: learner.stop())
    clean = False
    try:
        code = loop.run(learner)
        clean = code == 0
        return code
    finally:
        if dist.is_initialized():
            if clean:  # every rank done with its last collective before any tears gloo down (a crash at exit otherwise)
                dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(role_main(main, "learner"))
