"""Rendezvous stores a run opens listen on the host they were given, not on every interface; no
checkpoint is unpickled with code. (Issue 31: the learner's TCPStore listened on all interfaces, and an
EP checkpoint was loaded with ``weights_only=False``.)"""

from __future__ import annotations

import datetime
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LISTEN = "0A"  # TCP state in /proc/net/tcp*


def listening_hosts(port: int) -> set[str]:
    """The local addresses (hex, as /proc writes them) that listen on `port`."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            host, hport = fields[1].split(":")
            if int(hport, 16) == port and fields[3] == LISTEN:
                hosts.add(host)
    return hosts


LOOPBACK_V4 = "0100007F"
ANY = {"00000000", "00000000000000000000000000000000"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_plain_tcpstore_listens_on_every_interface():
    """The negative control: what torch does unless handed a socket, so the tests below can catch it."""
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    try:
        assert listening_hosts(port) & ANY
    finally:
        del store


def test_the_weight_sync_store_listens_on_loopback_alone():
    dist = pytest.importorskip("torch.distributed")
    from tidal.weight_sync.transport_dist import listening_fd

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False, master_listen_fd=listening_fd("127.0.0.1", port))
    try:
        assert listening_hosts(port) == {LOOPBACK_V4}
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store


def test_learner_ranks_rendezvous_on_a_loopback_store(tmp_path):
    """Two ranks started as the learner's `_spawn` starts them meet through rank 0's store, which
    listens on 127.0.0.1 only (checked from inside rank 0, while it runs)."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, socket, subprocess
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_listeners import listening_hosts
        if "RANK" in os.environ:
            import torch, torch.distributed as dist
            from tidal.integration.learner.process import _init_distributed
            _init_distributed("gloo")
            t = torch.ones(1)
            dist.all_reduce(t)
            if dist.get_rank() == 0:
                print("hosts", sorted(listening_hosts(int(os.environ["MASTER_PORT"]))), "sum", float(t), flush=True)
            dist.barrier()
            dist.destroy_process_group()
        else:
            from tidal.integration.learner.process import STORE_FD_ENV
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(16)
            port = str(listener.getsockname()[1])
            procs = []
            for r in range(2):
                env = {{**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port, STORE_FD_ENV: str(listener.fileno()) if r == 0 else "-"}}
                procs.append(subprocess.Popen([sys.executable, __file__], env=env,
                                              pass_fds=(listener.fileno(),) if r == 0 else ()))
            listener.close()
            try:
                codes = [p.wait(timeout=120) for p in procs]
            finally:
                for p in procs:
                    p.kill()
            sys.exit(max(codes))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"hosts ['{LOOPBACK_V4}'] sum 2.0" in out.stdout, out.stdout + out.stderr


UNSAFE_LOAD = re.compile(r"weights_only\s*=\s*False")


def test_no_source_unpickles_a_checkpoint_with_code():
    assert UNSAFE_LOAD.search("torch.load(p, weights_only=False)")  # the pattern catches the hole
    offenders = [str(p.relative_to(ROOT)) for top in ("packages", "integration", "tools")
                 for p in (ROOT / top).rglob("*.py")
                 if "/tests/" not in str(p) and UNSAFE_LOAD.search(p.read_text(errors="replace"))]
    assert offenders == []
