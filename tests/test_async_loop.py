"""The asynchronous loop with every role a real process: a rollout worker (embedded engine, arithmetic
environment) generates while the learner (single backend) trains on what the buffer serves, and the
learner's weights reach the worker in flight. The test plays the controller (issue 9 builds the real one)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tidal.core.arrays import Array
from tidal.core.channels import sub
from tidal.core.errors import ChannelTimeout
from tidal.core.protocol import Assignment, Metrics, SamplingParams
from tidal.core.testing import free_endpoint

pytestmark = pytest.mark.timeout(600)
STEPS, G = 4, 4


def test_generation_and_training_overlap_and_weights_flow_back(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from harness import Controller

    from tidal.rollout.envs.tasks import Arithmetic, first_tasks
    from tidal.rollout.tiny import build_tiny_model, load_tokenizer

    model = build_tiny_model(tmp_path / "model", seed=9)
    tok = load_tokenizer(model)
    ctl = Controller()
    ingest, serve, publish, weights = (free_endpoint() for _ in range(4))
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("buffer", "learner", "worker")}
    procs: dict[str, subprocess.Popen] = {}
    metrics: list[Metrics] = []
    try:
        procs["buffer"] = subprocess.Popen(
            [sys.executable, "-m", "tidal.buffer", f'ingest="{ingest}"', f'serve="{serve}"', f'publish="{publish}"',
             f'wal_dir="{tmp_path / "wal"}"', f"group_size={G}", f"batch_samples={2 * G}"],
            stdout=logs["buffer"], stderr=subprocess.STDOUT)
        procs["learner"] = subprocess.Popen(
            [sys.executable, "-m", "tidal.integration.learner", f'model="{model}"', f'buffer="{serve}"',
             f'publish="{weights}"', f"max_steps={STEPS}", "backend.options.optim.lr=1e-3"],
            stdout=logs["learner"], stderr=subprocess.STDOUT)
        metrics_sub = sub(weights, topics=["metrics"], linger=0)
        # PUB/SUB drops what is published before a subscription reaches the publisher: the worker (and
        # so the first batch) starts only once the learner's PUB is bound and we are subscribed
        deadline = time.monotonic() + 120
        while "learner up at version" not in (tmp_path / "learner.log").read_text():
            assert procs["learner"].poll() is None and time.monotonic() < deadline, \
                (tmp_path / "learner.log").read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(0.5)
        procs["worker"] = subprocess.Popen(
            [sys.executable, "-m", "tidal.rollout.worker.process", 'name="rollout-0"', f'controller="{ctl.endpoint}"',
             f'buffer_ingest="{ingest}"', f'buffer_acks="{publish}"', f'weights="{weights}"', f'model="{model}"',
             "max_groups=2", "heartbeat_interval_s=0.2"],
            stdout=logs["worker"], stderr=subprocess.STDOUT)
        tasks = first_tasks(Arithmetic(level=1), "train", 0, 64)
        ctl.assign(*[Assignment(group_id=f"a{i}", prompt_ids=Array.from_numpy(np.asarray(tok.encode(t.prompt), np.int32)),
                                num_samples=G, task="arithmetic", answer=t.answer,
                                sampling=SamplingParams(temperature=1.0, max_tokens=12)) for i, t in enumerate(tasks)])
        deadline = time.monotonic() + 400
        while procs["learner"].poll() is None and time.monotonic() < deadline:
            try:
                metrics.append(metrics_sub.recv(timeout=1)[1])
            except ChannelTimeout:
                pass
        assert procs["learner"].wait(timeout=60) == 0
        # the worker took the learner's versions while it kept generating
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not ctl.heartbeats or ctl.heartbeats[-1].version < STEPS):
            time.sleep(0.2)
        metrics_sub.close()
    finally:
        ctl.stop_workers()
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
        ctl.close()
        for name, f in logs.items():
            f.close()
            print(f"--- {name}\n{(tmp_path / f'{name}.log').read_text()[-2000:]}")
    versions = [m.scalars["train/version"] for m in metrics]
    assert versions == sorted(versions) and versions[-1] == STEPS
    assert ctl.heartbeats[-1].version == STEPS, "the worker should hold the learner's last version"
    lags = [m.scalars["staleness/lag_mean"] for m in metrics]
    assert len(lags) == STEPS and all(lag >= 0 for lag in lags)  # per-step lag of the trained tokens
    assert all(len(m.histograms["lag"].numpy()) > 0 for m in metrics)
    assert sum(1 for a in ctl.acks.values() if a.ok) >= STEPS * 2  # groups reported done
