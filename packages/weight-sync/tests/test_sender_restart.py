"""A weight sender that dies mid-fetch and a new one that comes up at the same endpoint (a restarted
learner): the dead sender's dropped connection, or `cancel()` for one that is alive but silent, ends the
receiver's fetch at once (not after the transport's 60 s timeout), and the next fetch, from the new
sender, brings its weights bit-exact. The senders are real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import torch

from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync import WeightFetchCancelled, WeightReceiver, WeightSenderGone

SENDER = """
import sys, time, msgspec, torch
from tidal.weight_sync import WeightSender
endpoint, version, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(seed)
sender = WeightSender("zmq", endpoint=endpoint, bucket_bytes=1 << 16)
ann = sender.send({f"w{i}": torch.randn(64, 64, generator=g) for i in range(8)}, version)
print(msgspec.json.encode(ann).decode(), flush=True)
while True:
    time.sleep(1)
"""


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 64, generator=g) for i in range(8)}


def start_sender(endpoint: str, version: int, seed: int) -> tuple[subprocess.Popen, WeightsAvailable]:
    proc = subprocess.Popen([sys.executable, "-c", SENDER, endpoint, str(version), str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # ends when the process exits, whatever happened
    if not line:
        proc.wait(timeout=30)
        raise RuntimeError(f"the sender did not start: {proc.stderr.read() if proc.stderr else ''}")
    return proc, msgspec.json.decode(line.encode(), type=WeightsAvailable)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def fetch_in_thread(receiver: WeightReceiver, ann: WeightsAvailable) -> tuple[threading.Thread, dict]:
    outcome: dict[str, object] = {}

    def fetch() -> None:
        try:
            receiver.receive(ann, lambda named: None)
            outcome["result"] = "received"
        except Exception as e:
            outcome["result"] = e
        outcome["at"] = time.monotonic()

    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    return t, outcome


def fetch_new_sender(receiver: WeightReceiver, endpoint: str) -> subprocess.Popen:
    """A new sender at the same endpoint, at an older version (a learner resumed from a checkpoint):
    the receiver fetches its weights bit-exact."""
    new, ann_new = start_sender(endpoint, version=5, seed=2)
    got: dict[str, torch.Tensor] = {}
    assert receiver.receive(ann_new, lambda named: got.update((n, t.clone()) for n, t in named)) == 5
    want = state(2)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    return new


def test_a_sender_that_dies_mid_fetch_ends_the_fetch_at_once(tmp_path):
    endpoint = f"ipc://{tmp_path}/w"
    old, ann_old = start_sender(endpoint, version=7, seed=1)
    new = None
    receiver = WeightReceiver("zmq", timeout=60.0)
    try:
        os.kill(old.pid, signal.SIGSTOP)  # connected, holds version 7, never serves it: the fetch waits
        t, outcome = fetch_in_thread(receiver, ann_old)
        time.sleep(0.5)
        assert t.is_alive(), f"the fetch should wait on the stopped sender: {outcome}"
        old.kill()  # SIGKILL reaches a stopped process: its connection drops
        old.wait(timeout=30)
        died = time.monotonic()
        t.join(timeout=10)
        assert not t.is_alive(), "the fetch still waits on a dead sender"
        assert isinstance(outcome["result"], WeightSenderGone), outcome
        assert float(outcome["at"]) - died < 3.0  # type: ignore[arg-type]
        assert receiver.version == -1  # nothing applied
        new = fetch_new_sender(receiver, endpoint)
    finally:
        receiver.close()
        stop(old)
        if new is not None:
            stop(new)


def test_cancel_ends_a_fetch_at_once(tmp_path):
    endpoint = f"ipc://{tmp_path}/w"
    old, ann_old = start_sender(endpoint, version=7, seed=1)
    new = None
    receiver = WeightReceiver("zmq", timeout=60.0)
    try:
        os.kill(old.pid, signal.SIGSTOP)  # alive (no disconnect) but silent: only cancel() ends the wait
        t, outcome = fetch_in_thread(receiver, ann_old)
        time.sleep(0.5)
        assert t.is_alive(), f"the fetch should wait on the stopped sender: {outcome}"
        cancelled_at = time.monotonic()
        receiver.cancel()  # what the rollout worker's applier does on a restarted learner's announcement
        t.join(timeout=10)
        assert not t.is_alive(), "cancel() did not end the fetch"
        assert isinstance(outcome["result"], WeightFetchCancelled), outcome
        assert float(outcome["at"]) - cancelled_at < 2.0  # type: ignore[arg-type]
        stop(old)
        new = fetch_new_sender(receiver, endpoint)
    finally:
        receiver.close()
        stop(old)
        if new is not None:
            stop(new)


@pytest.mark.timeout(60)
def test_a_fetch_not_cancelled_still_ends_at_its_timeout(tmp_path):
    endpoint = f"ipc://{tmp_path}/w"
    proc, ann = start_sender(endpoint, version=3, seed=1)
    receiver = WeightReceiver("zmq", timeout=1.0)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="sent 0 of .* buckets of version 3 within 1 s"):
            receiver.receive(ann, lambda named: None)
        assert time.monotonic() - t0 < 5
    finally:
        receiver.close()
        stop(proc)
