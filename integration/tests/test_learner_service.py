"""The learner process end to end with real peers: a buffer process feeds it a fixed stream of scored
groups, and a receiver process takes every version it publishes through tidal-weight-sync (zmq)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tidal.core.arrays import Array
from tidal.core.channels import sub
from tidal.core.errors import ChannelTimeout
from tidal.core.protocol import Metrics, Trajectory
from tidal.core.reliable import AckedPusher
from tidal.core.testing import free_endpoint

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(600)
STEPS, G = 12, 4


def test_learner_learns_from_the_buffer_and_publishes_every_version(tmp_path):
    from transformers import AutoModelForCausalLM

    from tidal.rollout.tiny import build_tiny_model, load_tokenizer

    model_path = build_tiny_model(tmp_path / "model", seed=7)
    tok = load_tokenizer(model_path)
    prompt, good, bad = tok.encode("3+4="), tok.encode("7\n"), tok.encode("8\n")
    ref = AutoModelForCausalLM.from_pretrained(model_path).eval()

    def logprobs(completion):
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0].numpy()

    # the toy objective: groups of G samples, half the right answer (reward 1), half a wrong one
    ingest, serve, publish, announce = (free_endpoint() for _ in range(4))
    procs = []
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tidal.buffer", f'ingest="{ingest}"', f'serve="{serve}"', f'publish="{publish}"',
             f'wal_dir="{tmp_path / "wal"}"', f"group_size={G}", f"batch_samples={2 * G}"],
            stdout=open(tmp_path / "buffer.log", "w"), stderr=subprocess.STDOUT))
        with AckedPusher(ingest, publish, "producer", resend_after=1.0) as out:
            for gi in range(2 * STEPS):
                for k in range(G):
                    comp = good if k % 2 == 0 else bad
                    out.send(Trajectory(
                        id=f"g{gi}:{k}", group_id=f"g{gi}", sample_index=k, task="arithmetic",
                        prompt_ids=Array.from_numpy(np.asarray(prompt, np.int32)),
                        completion_ids=Array.from_numpy(np.asarray(comp, np.int32)),
                        logprobs=Array.from_numpy(logprobs(comp)), versions=Array.from_numpy(np.zeros(len(comp), np.int32)),
                        reward=1.0 if comp is good else 0.0, finish_reason="stop", source="producer", group_size=G))
            out.flush(timeout=60)
        metrics_sub = sub(announce, topics=["metrics"], linger=0)
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "weights_receiver.py"), announce, str(model_path), str(tmp_path / "recv.jsonl"),
             json.dumps(prompt), json.dumps(good), str(STEPS)],
            stdout=open(tmp_path / "receiver.log", "w"), stderr=subprocess.STDOUT))
        time.sleep(3)  # the receiver subscribes before the first version is announced
        learner = subprocess.Popen(
            [sys.executable, "-m", "tidal.integration.learner", f'model="{model_path}"', f'buffer="{serve}"',
             f'publish="{announce}"', f"max_steps={STEPS}", "backend_options.optim.lr=3e-3",
             'train.loss={name="ppo"}', f'checkpoint_dir="{tmp_path / "ckpt"}"', "checkpoint_every=5"],
            stdout=open(tmp_path / "learner.log", "w"), stderr=subprocess.STDOUT)
        procs.append(learner)
        metrics: list[Metrics] = []
        deadline = time.monotonic() + 400
        while learner.poll() is None and time.monotonic() < deadline:
            try:
                metrics.append(metrics_sub.recv(timeout=1)[1])
            except ChannelTimeout:
                pass
        assert learner.wait(timeout=60) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        procs[1].wait(timeout=120)
        metrics_sub.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=20)
    received = [json.loads(line) for line in (tmp_path / "recv.jsonl").read_text().splitlines()]
    versions = [r["version"] for r in received]
    assert versions == sorted(versions) and versions[-1] == STEPS, versions
    first, last = received[0]["logp"], received[-1]["logp"]
    start = float(logprobs(good).sum())
    print(f"logp of the rewarded answer: {start:.3f} at start, {first:.3f} after step 1, {last:.3f} after {STEPS}")
    assert last > start + 1.0  # the learner pushed the rewarded answer up by more than one nat
    assert metrics and metrics[-1].scalars["train/version"] == STEPS
    assert (tmp_path / "ckpt" / "latest" / "progress.json").is_file()
    assert json.loads((tmp_path / "ckpt" / "latest" / "progress.json").read_text())["step"] == STEPS
