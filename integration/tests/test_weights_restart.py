"""A rollout worker's weight applier (real embedded engine, real zmq weight senders as processes) while
the learner dies mid-fetch and a restarted one announces an older version: the fetch from the dead
learner is given up at once (its connection dropped, or the new announcement cancels it; not after the
transport's 60 s timeout), counted as given up, not as a failure, and the restarted learner's weights
are applied next."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file

from tidal.core.channels import Waker
from tidal.core.protocol import WeightsAvailable
from tidal.rollout.engines.embedded import EmbeddedEngine
from tidal.rollout.tiny import build_tiny_model
from tidal.rollout.worker.applier import WeightApplier

SENDER = """
import sys, time, msgspec, torch
from safetensors.torch import load_file
from tidal.weight_sync import WeightSender
model, endpoint, version, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(seed)
state = {k: v + 0.01 * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in load_file(model).items()}
ann = WeightSender("zmq", endpoint=endpoint, bucket_bytes=1 << 16).send(state, version)
print(msgspec.json.encode(ann).decode(), flush=True)
while True:
    time.sleep(1)
"""


def start_learner(weights: Path, endpoint: str, version: int, seed: int) -> tuple[subprocess.Popen, WeightsAvailable]:
    proc = subprocess.Popen([sys.executable, "-c", SENDER, str(weights), endpoint, str(version), str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise RuntimeError(f"the sender did not start: {proc.stderr.read() if proc.stderr else ''}")
    return proc, msgspec.json.decode(line.encode(), type=WeightsAvailable)


def wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_a_restarted_learner_cancels_the_fetch_from_the_dead_one(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    weights = Path(model) / "model.safetensors"
    endpoint = f"ipc://{tmp_path}/w"
    dead, ann_dead = start_learner(weights, endpoint, version=7, seed=1)
    restarted = None
    waker = Waker()
    engine = EmbeddedEngine(str(model), max_num_seqs=2, weight_transport_options={"zmq": {"timeout": 60.0}})
    applier = WeightApplier(engine, waker, "rollout-0")
    applier.start()
    try:
        os.kill(dead.pid, signal.SIGSTOP)  # it will never serve version 7
        applier.announce(ann_dead)
        assert wait_for(lambda: applier._fetching is not None, 10), "the applier did not start fetching"
        dead.kill()
        dead.wait(timeout=30)
        restarted, ann_new = start_learner(weights, endpoint, version=5, seed=2)  # from an older checkpoint
        t0 = time.monotonic()
        applier.announce(ann_new)
        assert wait_for(lambda: engine.version == 5, 20), f"version {engine.version} held"
        took = time.monotonic() - t0
        assert took < 10, f"the restarted learner's weights took {took:.1f} s (the dead fetch was waited out)"
        # given up once (the dead sender's dropped connection, or the new announcement: whichever came first)
        assert (applier.cancelled, applier.failures, applier.updates) == (1, 0, 1)
        want = load_file(str(weights))
        g = torch.Generator().manual_seed(2)
        params = dict(engine.model.named_parameters())
        name = next(k for k in want if k in params)
        expected = {k: v + 0.01 * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in want.items()}[name]
        assert torch.equal(params[name].detach().cpu().to(expected.dtype), expected)
    finally:
        applier.close(timeout=10)
        engine.close()
        waker.close()
        for p in (dead, restarted):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.wait(timeout=30)
