"""The rollout worker as a real process against a real buffer process, with the test as controller.

- Lost acknowledgements: a fault-injecting proxy between the buffer's PUB and the worker drops acks
  (of whole groups: the worker sends each group as one message);
  the worker resends, the buffer deduplicates, the learner trains on every sample exactly once.
- kill -9 mid-group and restart: the buffer already holds some of the group's samples (their acks
  were lost on the way), the worker dies, a new one (same name) gets the group again and regenerates it
  with the same per-sample seeds; nothing acknowledged is lost and nothing is served twice.
- In-flight weights: a WeightsAvailable published over tidal-weight-sync's zmq transport is applied
  while groups are generating, and later trajectories carry the new version.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest

from tidal.buffer import BatchClient
from tidal.core.arrays import Array
from tidal.core.channels import pub, sub
from tidal.core.errors import ChannelTimeout
from tidal.core.interfaces import GenerationRequest
from tidal.core.protocol import Ack, Assignment, SamplingParams
from tidal.core.testing import free_endpoint

sys.path.insert(0, str(Path(__file__).parent))
from harness import Controller

pytestmark = pytest.mark.timeout(300)
G = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tidal.rollout.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=4)


class AckProxy:
    """Forwards the buffer's acks to the worker, dropping those whose ids are in `drop` (fault injection)."""

    def __init__(self, upstream: str) -> None:
        self.endpoint = free_endpoint()
        self.up = sub(upstream, linger=0)
        self.down = pub(self.endpoint, linger=0)
        self.drop: set[str] = set()
        self.drop_once: set[str] = set()
        self.dropped: Counter[str] = Counter()
        self.passed: set[str] = set()
        self.seen: set[str] = set()  # every id the buffer acknowledged (durable there)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                topic, msg = self.up.recv(timeout=0.05)
            except ChannelTimeout:
                continue
            if isinstance(msg, Ack) and msg.ok:
                keep = []
                for i in msg.ids:
                    # the worker sends groups: a group ack names the group, whose samples are <group>:<k>
                    members = [f"{i}:{k}" for k in range(G) if f"{i}:{k}" not in msg.refused] if msg.kind == "group" else [i]
                    self.seen.update(members)
                    if any(m in self.drop or m in self.drop_once for m in members):
                        self.drop_once.difference_update(members)
                        self.dropped.update(members)
                    else:
                        keep.append(i)
                        self.passed.update(members)
                if not keep:
                    continue
                msg = msgspec.structs.replace(msg, ids=keep)
            self.down.publish(topic, msg)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.up.close()
        self.down.close()


@pytest.fixture
def system(tmp_path, tiny, request):
    # In-process sockets bind first; the buffer's ports are picked after, and the test waits until the
    # buffer answers before anything else binds, so no two binders race for one free port.
    ctl = Controller()
    ingest, serve, publish = free_endpoint(), free_endpoint(), free_endpoint()
    buffer = subprocess.Popen(
        [sys.executable, "-m", "tidal.buffer", f'ingest="{ingest}"', f'serve="{serve}"', f'publish="{publish}"',
         f'wal_dir="{tmp_path / "wal"}"', f"group_size={G}", f"batch_samples={G}", "metrics_interval_s=0.5",
         *getattr(request, "param", [])],
        stdout=open(tmp_path / "buffer.log", "w"), stderr=subprocess.STDOUT,
    )
    learner = BatchClient(serve, retry_every=0.5)
    learner.status(timeout=60)  # the buffer is up and bound
    proxy = AckProxy(publish)
    workers: list[subprocess.Popen] = []

    def start_worker(name: str = "rollout-0", **extra: str) -> subprocess.Popen:
        args = [sys.executable, "-m", "tidal.rollout.worker.process", f'name="{name}"', f'controller="{ctl.endpoint}"',
                f'buffer_ingest="{ingest}"', f'buffer_acks="{proxy.endpoint}"', f'model="{tiny}"',
                "max_groups=2", "resend_after_s=0.5", "heartbeat_interval_s=0.2", "metrics_interval_s=0.5",
                *(f"{k}={v}" for k, v in extra.items())]
        log = open(tmp_path / f"{name}-{len(workers)}.log", "w")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TIDAL_LOG_LEVEL": "INFO"})
        workers.append(p)
        return p

    env = type("System", (), dict(ctl=ctl, proxy=proxy, learner=learner, start_worker=start_worker, tmp=tmp_path,
                                  workers=workers, buffer=buffer))
    try:
        yield env
    finally:
        ctl.stop_workers()
        for p in workers:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        learner.close()
        proxy.close()
        ctl.close()
        buffer.terminate()
        buffer.wait(timeout=20)
        for log in sorted(Path(tmp_path).glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-3000:]}")


def assignments(tok, n: int, prefix: str, max_tokens: int = 24) -> list[Assignment]:
    out = []
    for i in range(n):
        prompt = f"{i + 10}+{i}="
        ids = np.asarray(tok.encode(prompt), np.int32)
        out.append(Assignment(group_id=f"{prefix}{i}", prompt_ids=Array.from_numpy(ids), num_samples=G,
                              task="arithmetic", answer=str(2 * i + 10),
                              sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens)))
    return out


def drain(learner: BatchClient, n_groups: int, timeout: float = 180) -> list:
    """Everything the learner is served for n_groups groups (acknowledging each batch)."""
    got = []
    deadline = time.monotonic() + timeout
    prev = None
    while len({t.group_id for t in got}) < n_groups and time.monotonic() < deadline:
        try:
            batch = learner.next_batch(version=0, timeout=5, ack=prev)
        except TimeoutError:
            continue
        got.extend(batch.trajectories)
        prev = batch.batch_id
    if prev is not None:
        learner.ack(prev)
    return got


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_lost_acks_are_resent_and_never_duplicated(system, tiny):
    from tidal.rollout.tiny import load_tokenizer

    tok = load_tokenizer(tiny)
    work = assignments(tok, 4, "g")
    system.proxy.drop_once = {f"g0:{i}" for i in range(G)} | {f"g2:{i}" for i in range(G)}
    system.ctl.assign(*work)
    system.start_worker(acked_log=f'"{system.tmp}/acked-{{name}}.txt"')
    served = drain(system.learner, 4)
    ids = Counter(t.id for t in served)
    assert len(ids) == 4 * G and set(ids.values()) == {1}, ids
    assert sum(system.proxy.dropped.values()) == 2 * G  # the acks really were lost
    wait_for(lambda: len(system.ctl.acks) == 4, 60, "every group reported done")
    assert all(a.ok for a in system.ctl.acks.values())
    # the worker's own record: each acknowledged id once, however many times its ack was needed
    assert sorted((system.tmp / "acked-rollout-0.txt").read_text().split()) == sorted(ids)
    status = system.learner.status().scalars
    assert status["total/duplicates"] >= 2 * G  # the resends arrived and were recognised
    t = served[0]
    assert len(t.logprobs.numpy()) == len(t.completion_ids.numpy()) == len(t.versions.numpy())
    assert t.source == "rollout-0" and t.reward in (0.0, 1.0)
    wait_for(lambda: any(m.scalars["rollout/resent"] > 0 for m in system.ctl.metrics), 30, "resend metric")
    assert system.ctl.heartbeats and system.ctl.heartbeats[-1].role == "rollout"


def test_worker_killed_mid_group_and_restarted_loses_nothing_acknowledged(system, tiny):
    from tidal.rollout.tiny import load_tokenizer

    tok = load_tokenizer(tiny)
    work = assignments(tok, 4, "k", max_tokens=24)
    # g1's acks never reach the first worker: the buffer holds its samples, the worker waits on them
    system.proxy.drop = {f"k1:{i}" for i in range(G)}
    system.ctl.assign(*work)
    first = system.start_worker()
    wait_for(lambda: {f"k1:{i}" for i in range(G)} <= system.proxy.seen, 120, "k1 durable in the buffer")
    durable_before = set(system.proxy.seen)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    system.proxy.drop = set()
    again = system.ctl.requeue_unacked()
    assert "k1" in again
    system.start_worker()  # same name: the buffer acknowledges to it
    served = drain(system.learner, 4)
    ids = Counter(t.id for t in served)
    assert len(ids) == 4 * G and set(ids.values()) == {1}, ids
    assert durable_before <= set(ids)  # every acknowledged trajectory was trained on, once
    wait_for(lambda: {f"k{i}" for i in range(4)} <= set(system.ctl.acks), 60, "every group reported done")


def test_weights_announced_in_flight_are_applied(system, tiny):
    import torch
    from transformers import AutoModelForCausalLM

    from tidal.rollout.tiny import load_tokenizer
    from tidal.weight_sync import WeightSender

    tok = load_tokenizer(tiny)
    announce = free_endpoint()
    announcer = pub(announce, linger=0)
    try:
        system.start_worker(weights=f'"{announce}"')
        system.ctl.assign(*assignments(tok, 2, "w", max_tokens=48))
        first = drain(system.learner, 2)
        assert {int(v) for t in first for v in t.versions.numpy()} == {0}
        model = AutoModelForCausalLM.from_pretrained(tiny)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
        with WeightSender("zmq", bucket_bytes=1 << 20) as sender:
            ann = sender.send(model.state_dict(), 1)
            wait_for(lambda: bool(system.ctl.heartbeats), 30, "a heartbeat")
            deadline = time.monotonic() + 60
            while system.ctl.heartbeats[-1].version < 1 and time.monotonic() < deadline:
                announcer.publish("weights", ann)  # SUB joins late: announce until the worker holds it
                time.sleep(0.2)
            assert system.ctl.heartbeats[-1].version == 1
            system.ctl.assign(*assignments(tok, 2, "x", max_tokens=16))
            later = drain(system.learner, 2)
        assert {int(v) for t in later for v in t.versions.numpy()} == {1}
    finally:
        announcer.close()


@pytest.mark.parametrize("system", [['admission={name="version_rejection", options={max_lag=1}}']], indirect=True)
def test_refused_trajectories_settle_their_group_and_the_worker_goes_on(system, tiny):
    """The buffer refuses stale samples (the learner is far ahead): the worker reports those groups as
    not trained (ok=False, with the buffer's reason), frees their slots and keeps taking work."""
    from tidal.rollout.tiny import load_tokenizer

    tok = load_tokenizer(tiny)
    with pytest.raises(TimeoutError):
        system.learner.next_batch(version=5, timeout=1)  # tells the buffer the learner is at version 5
    system.ctl.assign(*assignments(tok, 5, "s", max_tokens=8))  # more groups than the worker's 2 slots
    system.start_worker()
    wait_for(lambda: len(system.ctl.acks) == 5, 120, "every group settled")
    assert not any(a.ok for a in system.ctl.acks.values())
    assert all("stale" in a.detail for a in system.ctl.acks.values()), [a.detail for a in system.ctl.acks.values()]


def test_usr1_writes_every_threads_stack_to_the_log_and_the_role_goes_on(system):
    """`kill -USR1 PID` on a role that seems stuck: each thread's Python stack lands in its log."""
    w = system.start_worker()
    log = system.tmp / "rollout-0-0.log"
    wait_for(lambda: "engine" in log.read_text(), 120, "the worker to start")
    for proc, path in ((w, log), (system.buffer, system.tmp / "buffer.log")):
        os.kill(proc.pid, signal.SIGUSR1)
        wait_for(lambda path=path: "most recent call first" in path.read_text(), 10, f"a stack dump in {path.name}")
        assert proc.poll() is None, f"{path.name}: the role died of the signal"
    assert log.read_text().count("Thread 0x") >= 2  # the main loop and the weights thread at least
    system.learner.status(timeout=10)  # the buffer still serves


def test_a_group_is_submitted_at_once_and_its_prompt_prefilled_once(tiny):
    """The worker hands the engine a group's G requests in one submission, so they join one step and the
    embedded engine feeds their shared prompt once; seeds are still the per-sample ones."""
    from tidal.rollout.engines.embedded import EmbeddedEngine
    from tidal.rollout.worker.process import RolloutWorker, WorkerConfig
    from tidal.rollout.worker.results import sample_seed

    prompt = [5, 6, 7, 8, 9, 10]
    cfg = WorkerConfig(name="submit-test", controller=free_endpoint(), buffer_ingest=free_endpoint(),
                       buffer_acks=free_endpoint(), model=str(tiny))
    engine = EmbeddedEngine(tiny, max_num_seqs=16)
    worker = RolloutWorker(cfg, engine=engine)
    try:
        worker._start_group(Assignment(group_id="g7", prompt_ids=Array.from_list(prompt, "int32"), num_samples=G,
                                       task="arithmetic", sampling=SamplingParams(max_tokens=3, ignore_eos=True)))
        results = []
        while len(results) < G:
            results += engine.poll(timeout=60)
        fed = engine.load_state()["tokens_fed"]
    finally:
        worker._close()
    assert sorted(r.request_id for r in results) == [f"g7:{i}" for i in range(G)]
    # one prompt prefill, then G sequences x 2 fed completion tokens (the third is sampled, not fed)
    assert fed == len(prompt) + G * 2
    alone = EmbeddedEngine(tiny, max_num_seqs=16, share_prompts=False)
    try:  # the same seeds with a prefill each give the same samples
        seeds = [sample_seed("g7", i, None) for i in range(G)]
        solo = {r.request_id: r for r in alone.generate(
            [GenerationRequest(request_id=f"g7:{i}", prompt_ids=prompt,
                               sampling=SamplingParams(max_tokens=3, ignore_eos=True, seed=s))
             for i, s in enumerate(seeds)], timeout=60)}
    finally:
        alone.close()
    assert all(solo[r.request_id].completion_ids == r.completion_ids for r in results)


def test_a_group_trained_on_its_survivors_is_settled_with_its_left_out_samples(system, tiny, monkeypatch):
    """episodes.on_error = "survivors": sample 1's `outcome()` raises; the worker delivers the other three
    (group_size 3: the baseline over the survivors) and acknowledges the group with left_out=1 and the
    failure's own text; the buffer holds the three as a whole group, the failed sample never."""
    here = str(Path(__file__).resolve().parents[1] / "packages" / "rollout" / "tests")  # envpool_plugins
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    a = Assignment(group_id="flaky-0", prompt_ids=Array.from_numpy(np.zeros(0, np.int32)), num_samples=G, task="flaky",
                   prompt="judge me", sampling=SamplingParams(temperature=1.0, max_tokens=4))
    system.ctl.assign(a)
    system.start_worker(**{"episodes.plugins": '["envpool_plugins"]', "episodes.processes": "1",
                           "episodes.on_error": '"survivors"', "domains": '[{env={name="flaky", options={fail=[1]}}}]',
                           "episodes.log_dir": f'"{system.tmp}"'})
    wait_for(lambda: "flaky-0" in system.ctl.acks, 120, "the group settled")
    ack = system.ctl.acks["flaky-0"]
    assert ack.ok and ack.left_out == 1 and "episode 1 cannot be judged" in ack.detail, ack
    # a whole group of three in the buffer (its batches are of G = 4 samples: this one alone makes none)
    wait_for(lambda: system.learner.status(timeout=5).scalars.get("depth/ready_samples") == 3, 30,
             "the survivors ready in the buffer")
    assert system.learner.status(timeout=5).scalars.get("depth/assembling_groups") == 0


def test_a_judged_domain_is_scored_off_the_loop_and_a_hanging_judge_costs_its_group(system, tiny):
    """A domain whose reward is the `judge` plugin, against a scripted judge over real HTTP that takes
    1 s a call: each group's samples are judged at once (the judge holds several calls together) while
    the worker's loop goes on (heartbeats keep coming); scores reach the buffer mapped to [0, 1]; a group
    whose judge call hangs past `timeout_s` is dropped as a reward error and counted, and the others go on."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "packages" / "rollout" / "tests"))
    from judge_server import JudgeServer

    from tidal.rollout.tiny import load_tokenizer

    server = JudgeServer(delay_s=1.0, hang_s=10)
    try:
        domains = ('[{ env = { name = "arithmetic" }, reward = { name = "judge", options = { endpoint = "'
                   + server.endpoint + '", rubric = "{reference}", timeout_s = 3.0, concurrency = 8 } } }]')
        system.start_worker(domains=domains)
        tok = load_tokenizer(tiny)
        groups = assignments(tok, 3, "j", max_tokens=8)
        groups = [msgspec.structs.replace(a, answer="HANG" if i == 1 else "SCORE=9") for i, a in enumerate(groups)]
        system.ctl.assign(*groups)
        got = drain(system.learner, 2, timeout=120)
        assert {t.group_id for t in got} == {"j0", "j2"}
        assert all(t.reward == pytest.approx(0.9) for t in got), [t.reward for t in got]
        wait_for(lambda: "j1" in system.ctl.acks, 60, "the hanging group's ack")
        assert not system.ctl.acks["j1"].ok and system.ctl.acks["j1"].reason == "reward_error"
        assert server.most_in_flight >= G  # a group's samples were judged together

        def last(key: str) -> float:
            return max((m.scalars.get(key, 0.0) for m in system.ctl.metrics), default=0.0)

        wait_for(lambda: last("reward/judge/errors/timeout") >= 1, 30, "the judge's timeouts in the metrics")
        assert last("rollout/groups/dropped/reward_error") == 1.0
        assert last("reward/judge/calls") >= 3 * G and last("reward/judge/latency_ms_median") >= 900
        # the loop was never held by the judge: heartbeats (every 0.2 s) kept coming while it answered
        times = [h.time for h in system.ctl.heartbeats]
        assert max(b - a for a, b in itertools.pairwise(times)) < 1.0
    finally:
        server.close()
