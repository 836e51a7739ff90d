"""Adversarial wire suite (issue 31): a real buffer process attacked on its real sockets. No frame crashes
or starves it, and what it stores passes its checks. Every attack has a negative control: a valid message
on the same path, from the same kind of sender, is accepted, so the probe is known to reach the service.

Attacks: a deeply nested body (ingest and serve), frames over the socket limit (a 4 MiB frame, and a raw
ZMTP peer announcing an 8 GB frame), forged trajectories (NaN reward, token id -5, versions at 1e9), and a
BatchRequest claiming learner version 1e9."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import zmq

from tidal.buffer import BatchClient
from tidal.core.arrays import Array
from tidal.core.channels import push
from tidal.core.codec import MAGIC, Codec
from tidal.core.protocol import PROTOCOL_VERSION, BatchRequest, Trajectory
from tidal.core.reliable import AckedPusher
from tidal.core.testing import free_endpoint, stop_process

PRE = MAGIC + bytes(PROTOCOL_VERSION)
VOCAB = 1000
LIMIT = 1024**2  # the buffer's ingest limit in this suite (max_message_bytes)


class Buffer:
    def __init__(self, tmp: Path) -> None:
        self.ingest, self.serve, self.publish = free_endpoint(), free_endpoint(), free_endpoint()
        self.log = tmp / "buffer.log"
        args = [f'ingest="{self.ingest}"', f'serve="{self.serve}"', f'publish="{self.publish}"',
                f'wal_dir="{tmp / "wal"}"', "group_size=1", "batch_samples=64", f"vocab_size={VOCAB}",
                f"max_message_bytes={LIMIT}", "fsync=\"never\"", "metrics_interval_s=0.5"]
        self.proc = subprocess.Popen([sys.executable, "-m", "tidal.buffer", *args], stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT)

    def status(self) -> dict[str, float]:
        with BatchClient(self.serve, name="probe") as c:
            return dict(c.status(timeout=10).scalars)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def buf(tmp_path_factory) -> Iterator[Buffer]:
    b = Buffer(tmp_path_factory.mktemp("adversarial"))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                b.status()
                break
            except TimeoutError:
                assert b.alive() and time.monotonic() < deadline, f"buffer did not start:\n{b.log.read_text()}"
        yield b
    finally:
        b.stop()


def traj(tid: str, source: str, *, reward: float = 1.0, token: int = 3, version: int = 0) -> Trajectory:
    n = 8
    return Trajectory(id=tid, group_id=tid, sample_index=0, task="t", prompt_ids=Array.from_list([1, 2], "int32"),
                      completion_ids=Array.from_list([token] + [3] * (n - 1), "int32"),
                      logprobs=Array.from_list([-0.5] * n, "float32"), versions=Array.from_list([version] * n, "int32"),
                      reward=reward, finish_reason="stop", source=source)


def accepted(buf: Buffer, source: str, t: Trajectory) -> bool:
    """Send `t` reliably; True when the buffer acknowledged it (stored), False when it refused it."""
    with AckedPusher(buf.ingest, buf.publish, source, resend_after=0.5) as p:
        time.sleep(0.2)  # the ack subscription reaches the buffer's PUB
        p.send(t)
        p.flush(timeout=15)
        return t.id not in p.rejected


def wait_for(buf: Buffer, key: str, at_least: float, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        s = buf.status()
        if s.get(key, 0.0) >= at_least or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def test_a_deeply_nested_frame_on_ingest_is_a_counted_protocol_error_and_the_buffer_serves_on(buf):
    before = buf.status().get("errors/protocol", 0.0)
    with push(buf.ingest, linger=1.0) as rogue:
        for tag in (b"", b"\x92\xaaTrajectory"):  # untagged, and tagged as a Trajectory
            rogue.socket.send(PRE + tag + b"\x91" * 200_000 + b"\xc0")
    s = wait_for(buf, "errors/protocol", before + 2)
    assert s["errors/protocol"] >= before + 2 and buf.alive()
    assert accepted(buf, "nest-ok", traj("nest-ok", "nest-ok"))  # control: the same socket still takes data


def test_a_deeply_nested_request_on_serve_gets_an_error_reply_and_status_still_answers(buf):
    before = buf.status().get("errors/protocol", 0.0)
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.linger = 0
    try:
        d.connect(buf.serve)
        d.send(PRE + b"\x92\xacBatchRequest" + b"\x91" * 200_000 + b"\xc0")
        assert d.poll(10_000), "the buffer did not answer the nested request"
        reply = Codec().decode([d.recv()])
        assert type(reply).__name__ == "Error" and reply.code == "protocol"
        d.send(Codec().encode(_status())[0])  # control: a valid request on the same socket
        assert d.poll(10_000) and type(Codec().decode([d.recv()])).__name__ == "Metrics"
    finally:
        d.close(0)
    assert buf.status()["errors/protocol"] >= before + 1 and buf.alive()


def _status():
    from tidal.core.protocol import Control

    return Control(command="status")


def test_a_frame_over_the_ingest_limit_is_dropped_unread(buf):
    before = buf.status()
    big = traj("too-big", "big")
    big.prompt_ids = Array.from_numpy(np.ones(LIMIT, np.int32))  # 4 MiB: over the 1 MiB limit
    with push(buf.ingest, linger=1.0) as rogue:
        rogue.send(big, timeout=5)
    time.sleep(0.5)
    after = buf.status()
    # libzmq dropped it (and its connection) before the codec saw it: not stored, not even a protocol error
    assert after.get("total/accepted") == before.get("total/accepted") and buf.alive()
    assert after.get("errors/protocol", 0) == before.get("errors/protocol", 0)
    assert accepted(buf, "big-ok", traj("big-ok", "big-ok"))  # control


def _zmtp_push(endpoint: str) -> socket.socket:
    """A raw TCP peer that completes a ZMTP 3.0 NULL handshake as a PUSH socket, step by step (greeting
    signature, rest of the greeting, READY), reading the buffer's side of each before going on."""
    u = urlparse(endpoint)
    s = socket.create_connection((u.hostname, u.port), timeout=10)

    def read(n: int) -> bytes:
        got = b""
        while len(got) < n:
            chunk = s.recv(n - len(got))
            assert chunk, "the buffer closed the connection during the handshake"
            got += chunk
        return got

    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    s.sendall(greeting[:10])
    read(10)
    s.sendall(greeting[10:])
    read(54)
    props = b"\x0bSocket-Type" + (4).to_bytes(4, "big") + b"PUSH"
    ready = b"\x05READY" + props
    s.sendall(b"\x04" + bytes([len(ready)]) + ready)
    flags = read(1)[0]  # the buffer's READY command
    read(read(1)[0] if flags == 0x04 else int.from_bytes(read(8), "big"))
    return s


def _closed_by_peer(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not s.recv(65536):  # the peer's greeting and READY, then EOF
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def test_a_peer_announcing_an_8_gb_frame_is_disconnected_without_the_buffer_growing(buf):
    rss = buf.rss_mib()
    s = _zmtp_push(buf.ingest)
    try:
        s.sendall(b"\x02" + (8 * 1024**3).to_bytes(8, "big") + b"\x00" * 65536)  # a long frame: 8 GB claimed
        assert _closed_by_peer(s, 10), "the buffer kept reading an 8 GB frame"
    finally:
        s.close()
    assert buf.alive() and buf.rss_mib() < rss + 64
    # control: the same raw peer with a real (small) message is heard, and its trajectory acknowledged
    t = traj("raw-ok", "raw-ok")
    frame = bytes(Codec(inline_threshold=1 << 62).encode(t)[0])
    with AckedPusher(buf.ingest, buf.publish, "raw-ok", resend_after=60) as p:  # listens for the ack only
        time.sleep(0.2)
        p.pending["raw-ok"] = (t, time.monotonic())
        s = _zmtp_push(buf.ingest)
        try:
            deadline = time.monotonic() + 10
            while p.pending and time.monotonic() < deadline:  # sent again until acked (an early ack may be missed)
                s.sendall(b"\x00" + bytes([len(frame)]) + frame if len(frame) < 256
                          else b"\x02" + len(frame).to_bytes(8, "big") + frame)
                p.poll(timeout=0.5)
        finally:
            s.close()
        assert p.acked == 1, "the raw ZMTP control message was not acknowledged"


@pytest.mark.parametrize("forgery, reason", [
    (dict(reward=float("nan")), "nonfinite_reward"),
    (dict(token=-5), "token_out_of_range"),
    (dict(token=VOCAB), "token_out_of_range"),
    (dict(version=10**9), "version_ahead"),
])
def test_a_forged_trajectory_is_refused_counted_and_its_sender_told(buf, forgery, reason):
    with BatchClient(buf.serve, name="learner") as learner, pytest.raises(TimeoutError):
        learner.next_batch(version=0, timeout=0.3)  # the learner's version is known (the version check is on)
    name = f"forge-{reason}-{len(str(forgery))}"
    before = buf.status().get(f"refused/{reason}", 0.0)
    with AckedPusher(buf.ingest, buf.publish, name, resend_after=0.5) as p:
        time.sleep(0.2)
        p.send(traj(f"{name}-bad", name, **forgery))
        p.send(traj(f"{name}-ok", name))  # control: the same sender, the same path, valid
        p.flush(timeout=15)
        assert list(p.rejected) == [f"{name}-bad"] and p.acked == 1
    assert buf.status()[f"refused/{reason}"] == before + 1


def test_a_batch_request_claiming_version_1e9_moves_the_learner_version_a_bounded_step(buf):
    def status_after(*versions: int) -> dict[str, float]:
        """Send BatchRequests for `versions`, then a status request, in order on one socket: the reply
        reflects every request before it."""
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.linger = 0
        try:
            d.connect(buf.serve)
            codec = Codec()
            for v in versions:
                d.send(codec.encode(BatchRequest(rank=7, world_size=8, version=v))[0])
            d.send(codec.encode(_status())[0])
            deadline = time.monotonic() + 10
            while d.poll(max(1, int(1000 * (deadline - time.monotonic())))):
                msg = codec.decode([d.recv()])
                if type(msg).__name__ == "Metrics":
                    return dict(msg.scalars)
            raise AssertionError("the buffer did not answer the status request")
        finally:
            d.close(0)

    v0 = int(status_after(0)["learner_version"])  # a version the buffer already holds: no change
    s = status_after(v0 + 10)  # a real step forward (within max_version_step): believed
    assert s["learner_version"] == v0 + 10
    jumps = s["errors/version_jump"]
    s = status_after(10**9)
    assert s["errors/version_jump"] == jumps + 1 and s["learner_version"] == v0 + 10 + 64  # max_version_step
    assert status_after(v0 + 75)["learner_version"] == v0 + 75  # control: the next real step is believed again
