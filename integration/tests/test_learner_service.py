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
        # no wait for the receiver to subscribe: one that joins late gets the latest version re-announced
        # (weights.reannounce_s), and the learner's last version waits for it (weights.final_wait_s)
        learner = subprocess.Popen(
            [sys.executable, "-m", "tidal.integration.learner", f'model="{model_path}"', f'buffer="{serve}"',
             f'publish="{announce}"', f"max_steps={STEPS}", "backend.options.optim.lr=3e-3",
             'train.loss={name="ppo"}', f'checkpoint_dir="{tmp_path / "ckpt"}"', "checkpoint_every=5",
             f'record_batches="{tmp_path / "recording"}"', f'export_dir="{tmp_path / "trained"}"'],
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
    _replay_trains_the_same_policy(tmp_path, model_path)


def _replay_trains_the_same_policy(tmp_path: Path, model_path: Path) -> None:
    """The batches the learner recorded, replayed by a learner with no buffer (learner.source = "replay"),
    train the same policy from the same start: the same weights, to float precision."""
    from safetensors.torch import load_file

    replay = subprocess.run(
        [sys.executable, "-m", "tidal.integration.learner", f'model="{model_path}"', f'publish="{free_endpoint()}"',
         f'source={{name="replay", options={{path="{tmp_path / "recording"}"}}}}', "weights.every=0",
         "backend.options.optim.lr=3e-3", 'train.loss={name="ppo"}', f'export_dir="{tmp_path / "replayed"}"'],
        capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert f"finished after {STEPS} batches" in replay.stderr, replay.stderr[-3000:]
    trained, replayed = load_file(tmp_path / "trained" / "model.safetensors"), load_file(tmp_path / "replayed" / "model.safetensors")
    assert trained.keys() == replayed.keys()
    start = load_file(model_path / "model.safetensors")
    assert any(not torch.equal(start[k], trained[k]) for k in trained)  # training moved the weights
    for k in trained:
        torch.testing.assert_close(replayed[k], trained[k], rtol=0, atol=1e-5, msg=k)


def test_a_replay_of_a_missing_recording_is_refused_naming_what_is_there(tmp_path):
    from tidal.rollout.tiny import build_tiny_model

    model_path = build_tiny_model(tmp_path / "model", seed=7)
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "batches-1.msgpack").write_bytes(b"")
    out = subprocess.run(
        [sys.executable, "-m", "tidal.integration.learner", f'model="{model_path}"', f'publish="{free_endpoint()}"',
         f'source={{name="replay", options={{path="{tmp_path / "rec"}"}}}}', "weights.every=0"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "no recording" in out.stderr and "batches-0.msgpack" in out.stderr and "batches-1.msgpack" in out.stderr, \
        out.stderr[-2000:]


def _push_groups(ingest: str, publish: str, tok, n_groups: int) -> None:
    prompt, answer = tok.encode("3+4="), tok.encode("7\n")
    with AckedPusher(ingest, publish, "producer", resend_after=1.0) as out:
        for gi in range(n_groups):
            for k in range(G):
                out.send(Trajectory(
                    id=f"g{gi}:{k}", group_id=f"g{gi}", sample_index=k, task="arithmetic",
                    prompt_ids=Array.from_numpy(np.asarray(prompt, np.int32)),
                    completion_ids=Array.from_numpy(np.asarray(answer, np.int32)),
                    logprobs=Array.from_numpy(np.full(len(answer), -1.0, np.float32)),
                    versions=Array.from_numpy(np.zeros(len(answer), np.int32)),
                    reward=float(k % 2), finish_reason="stop", source="producer", group_size=G))
        out.flush(timeout=60)


def _start_buffer(tmp_path: Path, batch_samples: int) -> tuple[subprocess.Popen, tuple[str, str, str, str]]:
    """A buffer process (groups of G, `batch_samples` a batch; log in tmp_path) and four endpoints:
    its ingest, serve and publish, and one for the learner's announcements."""
    ingest, serve, publish, announce = (free_endpoint() for _ in range(4))
    buffer = subprocess.Popen(
        [sys.executable, "-m", "tidal.buffer", f'ingest="{ingest}"', f'serve="{serve}"', f'publish="{publish}"',
         f'wal_dir="{tmp_path / "wal"}"', f"group_size={G}", f"batch_samples={batch_samples}"],
        stdout=open(tmp_path / "buffer.log", "w"), stderr=subprocess.STDOUT)
    return buffer, (ingest, serve, publish, announce)


def _stop(learner: subprocess.Popen | None, buffer: subprocess.Popen) -> None:
    """Whatever still runs: the learner's process group killed (it started its own session), the buffer
    terminated."""
    import os
    import signal

    if learner is not None and learner.poll() is None:
        os.killpg(learner.pid, signal.SIGKILL)
        learner.wait(timeout=30)
    if buffer.poll() is None:
        buffer.terminate()
        buffer.wait(timeout=30)


@pytest.mark.slow
def test_two_fsdp2_ranks_killed_between_checkpoints_train_every_sample_once(tmp_path):
    """Two learner ranks (FSDP2, gloo) acknowledge at their checkpoints: killed one step past a
    checkpoint, they resume from it and are served that step's shares again; stopped (SIGTERM) while
    waiting for data, both leave at the same step and checkpoint. Every sample was trained on exactly
    once, by one rank, and the buffer holds nothing unacknowledged."""
    import os
    import signal

    from tidal.buffer.client import BatchClient
    from tidal.rollout.tiny import build_tiny_model, load_tokenizer

    steps = 5
    model_path = build_tiny_model(tmp_path / "model", seed=3)
    buffer, (ingest, serve, publish, announce) = _start_buffer(tmp_path, 2 * G)
    learner: subprocess.Popen | None = None

    def start_learner(max_steps: int) -> subprocess.Popen:
        log = open(tmp_path / "learner.log", "a")
        return subprocess.Popen(
            [sys.executable, "-m", "tidal.integration.learner", "--nproc", "2", f'model="{model_path}"',
             f'buffer="{serve}"', f'publish="{announce}"', f"max_steps={max_steps}", 'backend.name="fsdp2"',
             "weights.every=0", f'checkpoint_dir="{tmp_path / "ckpt"}"', "checkpoint_every=2",
             "record_trained_ids=true", "keep_checkpoints=2", f'export_dir="{tmp_path / "exported"}"'],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    try:
        _push_groups(ingest, publish, load_tokenizer(model_path), 2 * steps)  # one group per rank per step
        def wait_for_log(line: str) -> None:
            deadline = time.monotonic() + 300
            while line not in (tmp_path / "learner.log").read_text():
                assert learner.poll() is None and time.monotonic() < deadline, (tmp_path / "learner.log").read_text()[-3000:]
                time.sleep(0.05)

        learner = start_learner(steps)
        wait_for_log("step 3 ")  # trained, not checkpointed (that was at step 2)
        os.killpg(learner.pid, signal.SIGKILL)
        learner.wait(timeout=30)
        learner = start_learner(0)  # until stopped
        wait_for_log("step 5 ")  # every sample trained; both ranks now wait for data that never comes
        time.sleep(1.0)
        os.killpg(learner.pid, signal.SIGTERM)
        assert learner.wait(timeout=120) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        with BatchClient(serve) as probe:
            status = probe.status(timeout=30).scalars
    finally:
        _stop(learner, buffer)
    text = (tmp_path / "learner.log").read_text()
    assert "resumed from" in text and "at step 2 " in text, text[-3000:]
    progress = json.loads((tmp_path / "ckpt" / "latest" / "progress.json").read_text())
    trained = progress["trained_ids"]
    assert progress["step"] == steps
    assert len(trained) == len(set(trained)) == steps * 2 * G, "a sample was trained twice, or lost"
    assert {b.rsplit("-", 1)[1] for b in progress["trained"]} == {"r0", "r1"}  # both ranks' batch ids
    assert status["depth/outstanding_batches"] == 0.0 and status["total/consumed"] == steps * 2 * G
    # stopped cleanly, the ranks gathered their shards and rank 0 wrote the policy: the weights of the
    # exit checkpoint (torch.distributed.checkpoint, read whole in this process); the newest two kept
    from safetensors.torch import load_file

    from tidal.learner.checkpoint import checkpoint_weights

    exported = load_file(tmp_path / "exported" / "model.safetensors")
    final = checkpoint_weights(tmp_path / "ckpt" / "latest", model_path)
    assert set(final) - set(exported) <= {"lm_head.weight"}  # a tied head is saved once
    assert all(torch.equal(exported[k], final[k]) for k in exported)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step-000004", "step-000005"]


@pytest.mark.slow
def test_one_prefetching_learner_killed_and_stopped_mid_prefetch_trains_every_sample_once(tmp_path):
    """One process asks for the next batch (and packs it) while it trains (`prefetch`, the default): killed
    with -9 one step past a checkpoint while holding a prefetched batch, it resumes and is served that
    step's batch and the prefetched one again; stopped (SIGTERM) while its prefetch waits for data that
    never comes, it leaves at once, checkpointed. Every sample was trained on exactly once, every batch's
    acknowledgement (sent with the next request when prefetching) reached the buffer."""
    import os
    import signal

    from tidal.buffer.client import BatchClient
    from tidal.rollout.tiny import build_tiny_model, load_tokenizer

    steps = 5
    model_path = build_tiny_model(tmp_path / "model", seed=3)
    buffer, (ingest, serve, publish, announce) = _start_buffer(tmp_path, G)
    learner: subprocess.Popen | None = None
    log_path = tmp_path / "learner.log"

    def start_learner(max_steps: int, s_per_sample: float = 0.0) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "tidal.integration.learner", f'model="{model_path}"', f'buffer="{serve}"',
             f'publish="{announce}"', f"max_steps={max_steps}", "weights.every=0", "prefetch=true",
             f"simulate_s_per_sample={s_per_sample}",
             f'checkpoint_dir="{tmp_path / "ckpt"}"', "checkpoint_every=2", "record_trained_ids=true"],
            stdout=open(log_path, "a"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for_log(line: str) -> None:
        deadline = time.monotonic() + 300
        while line not in log_path.read_text():
            assert learner is not None and learner.poll() is None and time.monotonic() < deadline, \
                log_path.read_text()[-3000:]
            time.sleep(0.05)

    try:
        _push_groups(ingest, publish, load_tokenizer(model_path), steps)  # one group a step
        learner = start_learner(steps, s_per_sample=0.25)  # a second a step: the kill lands before step 4
        wait_for_log("step 3 ")  # trained, not checkpointed (that was at step 2); step 4's batch prefetched
        os.killpg(learner.pid, signal.SIGKILL)
        learner.wait(timeout=30)
        learner = start_learner(0)  # until stopped
        wait_for_log("step 5 ")  # every sample trained; the prefetch of step 6 waits for data that never comes
        time.sleep(1.0)
        t0 = time.monotonic()
        os.killpg(learner.pid, signal.SIGTERM)
        assert learner.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        stop_s = time.monotonic() - t0
        with BatchClient(serve) as probe:
            status = probe.status(timeout=30).scalars
    finally:
        _stop(learner, buffer)
    text = log_path.read_text()
    assert "resumed from" in text and "at step 2 " in text, text[-3000:]
    progress = json.loads((tmp_path / "ckpt" / "latest" / "progress.json").read_text())
    trained = progress["trained_ids"]
    assert progress["step"] == steps
    assert len(trained) == len(set(trained)) == steps * G, "a sample was trained twice, or lost"
    assert status["depth/outstanding_batches"] == 0.0 and status["total/consumed"] == steps * G, status
    assert stop_s < 30, f"stopping took {stop_s:.1f} s: the pending prefetch held the learner"


@pytest.mark.slow
def test_a_learner_whose_step_fails_exits_while_its_prefetch_waits_for_data(tmp_path):
    """A step that raises (here: a token id the model's vocabulary does not have, from a producer with
    another tokenizer) while the next batch's prefetch waits for data that never comes: the learner exits
    with the error within seconds, not after `batch_timeout_s` (the prefetch thread is told to stop)."""
    from tidal.rollout.tiny import build_tiny_model

    model_path = build_tiny_model(tmp_path / "model", seed=3)
    buffer, (ingest, serve, publish, announce) = _start_buffer(tmp_path, G)
    try:
        with AckedPusher(ingest, publish, "producer", resend_after=1.0) as out:
            for k in range(G):  # one batch; its completion holds an id far outside the 79-token vocabulary
                out.send(Trajectory(
                    id=f"g0:{k}", group_id="g0", sample_index=k, task="arithmetic",
                    prompt_ids=Array.from_numpy(np.asarray([1, 5, 6], np.int32)),
                    completion_ids=Array.from_numpy(np.asarray([7, 50_000], np.int32)),
                    logprobs=Array.from_numpy(np.full(2, -1.0, np.float32)),
                    versions=Array.from_numpy(np.zeros(2, np.int32)),
                    reward=float(k % 2), finish_reason="stop", source="producer", group_size=G))
            out.flush(timeout=60)
        t0 = time.monotonic()
        learner = subprocess.run(
            [sys.executable, "-m", "tidal.integration.learner", f'model="{model_path}"', f'buffer="{serve}"',
             f'publish="{announce}"', "weights.every=0", "prefetch=true", "batch_timeout_s=600"],
            capture_output=True, text=True, timeout=240)
        took = time.monotonic() - t0
    finally:
        buffer.terminate()
        buffer.wait(timeout=30)
    assert learner.returncode != 0, learner.stdout[-2000:] + learner.stderr[-2000:]
    assert "IndexError" in learner.stderr + learner.stdout, learner.stderr[-2000:]
    assert took < 120, f"the learner took {took:.0f} s to exit after its step failed"
