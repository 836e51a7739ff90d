"""A stranger on the same host against a real buffer process started with a run's keys (as `tidal run`
starts it): with no keys, a wrong server key, or the right server public key and a key of its own that
the run does not list, it cannot push a trajectory, take a batch, acknowledge one, stop the buffer or
read the acks; each try is counted (auth/refused) and the buffer keeps serving. Each probe is run again
with the run's own worker / learner / driver key and succeeds, so the refusals are the keys' doing, not a
probe that never reaches the service. A worker's key is let in at ingest but refused (role check) when
it asks for a batch or tries to stop the buffer."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from tidal.buffer.client import BatchClient
from tidal.buffer.config import BufferConfig
from tidal.core.channels import dealer, push, sub
from tidal.core.errors import ChannelTimeout
from tidal.core.protocol import ACK_BATCH, Ack, Control, Error, Metrics
from tidal.core.reliable import ack_topic
from tidal.core.security import ChannelSecurity, CurveClient, make_role_keys
from tidal.core.testing import make_trajectory, stop_process

STRANGERS = ["no_keys", "wrong_server_key", "unlisted_key"]


def _send(ch, msg, timeout: float = 1.0) -> None:
    """Send, or find the message cannot even be queued: a refused connection never completes, so a
    DEALER or PUSH has no peer to queue it for. Either way nothing may arrive."""
    try:
        ch.send(msg, timeout=timeout)
    except ChannelTimeout:
        pass


class Run:
    """The buffer of a run, its keys, and the curves its roles (and strangers) connect with."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tidal-adv-"))  # short: ipc paths have a ~107-byte limit
        self.keys = make_role_keys(self.dir / "keys", ["buffer", "learner", "driver", "rollout-0", "stranger"])
        ep = {k: f"ipc://{self.dir}/{k}" for k in ("ingest", "serve", "publish")}
        cfg = BufferConfig(**ep, wal_dir=str(self.dir / "wal"), group_size=1, batch_samples=1, metrics_interval_s=0.5,
                           security=ChannelSecurity.from_role_keys(self.keys, "buffer",
                                                                   clients=["learner", "driver", "rollout-0"]))
        self.ingest, self.serve, self.publish = ep["ingest"], ep["serve"], ep["publish"]
        self.proc: subprocess.Popen | None = None
        (self.dir / "buffer.json").write_bytes(msgspec.json.encode(cfg))
        self.log = self.dir / "buffer.log"
        self.n = 0
        self.buffer_key = self.role("buffer").server_key

    def start(self) -> None:
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tidal.buffer", "--config", str(self.dir / "buffer.json")],
                                         stdout=out, stderr=subprocess.STDOUT)

    def role(self, name: str) -> CurveClient:
        curve = ChannelSecurity.from_role_keys(self.keys, name, servers=["buffer"]).client("buffer")
        assert curve is not None
        return curve

    def stranger(self, how: str) -> CurveClient | None:
        if how == "no_keys":
            return None
        if how == "wrong_server_key":
            public, secret = zmq.curve_keypair()
            return CurveClient(zmq.curve_keypair()[0], public, secret)
        return self.role("stranger")  # the right server key, a pair the run does not list

    def status(self) -> dict[str, float]:
        with BatchClient(self.serve, name="driver", curve=self.role("driver")) as c:
            return dict(c.status(timeout=10).scalars)

    def wait_up(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                self.status()
                return
            except ChannelTimeout:
                assert self.proc is not None
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"buffer did not start:\n{self.log.read_text()}") from None

    def wait(self, what: str, holds, timeout: float = 5.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            s = self.status()
            if holds(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: buffer status {s}")
            time.sleep(0.1)

    def traj(self):
        self.n += 1
        return msgspec.structs.replace(make_trajectory(self.n), source="rollout-0", group_id=f"g{self.n}",
                                      sample_index=0)

    def push_from(self, curve) -> None:
        with push(self.ingest, curve=curve, linger=2.0) as out:
            _send(out, self.traj(), 5 if curve is not None and curve.server_key == self.buffer_key else 1)

    def close(self) -> None:
        stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def run():
    r = Run()
    try:
        r.start()
        r.wait_up()
        yield r
    finally:
        r.close()


def _refused_more(before: dict[str, float]):
    return lambda s: s["auth/refused"] > before["auth/refused"]


@pytest.mark.parametrize("how", STRANGERS)
def test_a_stranger_cannot_push_a_trajectory(run, how):
    before = run.status()
    run.push_from(run.stranger(how))
    after = run.wait("stranger's push refused and counted", _refused_more(before))
    time.sleep(0.3)
    assert run.status()["total/accepted"] == before["total/accepted"]  # nothing stored
    run.push_from(run.role("rollout-0"))  # negative control: the run's worker gets in
    run.wait("the worker's push stored", lambda s: s["total/accepted"] == after["total/accepted"] + 1)


@pytest.mark.parametrize("how", STRANGERS)
def test_a_stranger_cannot_take_or_acknowledge_a_batch(run, how):
    run.push_from(run.role("rollout-0"))
    before = run.wait("a batch ready", lambda s: s["depth/ready_samples"] >= 1)
    with BatchClient(run.serve, name="thief", curve=run.stranger(how), retry_every=0.5) as thief:
        with pytest.raises(ChannelTimeout):
            thief.next_batch(version=99, timeout=1.5)
    s = run.wait("stranger's request refused and counted", _refused_more(before))
    assert s["total/served"] == before["total/served"] and s["learner_version"] == before["learner_version"]
    with BatchClient(run.serve, name="learner-0", curve=run.role("learner")) as learner:  # negative control
        batch = learner.next_batch(version=0, timeout=10)
        served = run.status()
        with dealer(run.serve, curve=run.stranger(how), linger=0) as thief:  # an ack it never trained
            _send(thief, Ack(kind=ACK_BATCH, ids=[batch.batch_id]))
            with pytest.raises(ChannelTimeout):
                thief.recv(timeout=1.0)
        time.sleep(0.3)
        s = run.status()
        assert s["total/consumed"] == served["total/consumed"]  # not consumed: the learner still holds it
        learner.ack(batch.batch_id, timeout=10)  # negative control: the learner's ack is taken
    run.wait("the learner's ack consumed the batch", lambda s: s["total/consumed"] == served["total/consumed"] + 1)


@pytest.mark.parametrize("how", STRANGERS)
def test_a_stranger_cannot_stop_the_buffer_or_read_its_acks(run, how):
    before = run.status()
    with dealer(run.serve, curve=run.stranger(how), linger=0) as c:
        _send(c, Control(command="stop", reason="stranger"))
        with pytest.raises(ChannelTimeout):
            c.recv(timeout=1.0)
    run.wait("stranger's stop refused and counted", _refused_more(before))
    assert run.proc.poll() is None  # still serving
    with sub(run.publish, topics=[ack_topic("rollout-0")], curve=run.stranger(how), linger=0) as eaves, \
            sub(run.publish, topics=[ack_topic("rollout-0")], curve=run.role("rollout-0"), linger=0) as worker:
        time.sleep(0.5)  # subscriptions travel
        run.push_from(run.role("rollout-0"))
        _topic, ack = worker.recv(timeout=10)  # negative control: the worker hears its ack
        assert isinstance(ack, Ack)
        with pytest.raises(ChannelTimeout):
            eaves.recv(timeout=0.5)


def test_a_worker_key_may_push_but_not_take_batches_or_stop_the_buffer(run):
    before = run.status()
    with dealer(run.serve, curve=run.role("rollout-0"), linger=0) as worker:
        for msg in (Control(command="stop", reason="worker"), Control(command="status")):
            _send(worker, msg)  # the serve socket lets only the learner and the driver in
            with pytest.raises(ChannelTimeout):
                worker.recv(timeout=1.0)
    run.wait("a worker key refused at serve", _refused_more(before))
    assert run.proc.poll() is None


def test_role_checks_on_serve_learner_cannot_stop_driver_cannot_take_batches(run):
    before = run.status()
    with dealer(run.serve, curve=run.role("learner"), linger=0) as learner:
        reply = learner.request(Control(command="stop", reason="learner"), timeout=5)
        assert isinstance(reply, Error) and "role check" in reply.detail
    with BatchClient(run.serve, name="driver", curve=run.role("driver")) as driver:
        with pytest.raises(Exception, match="role check"):
            driver.next_batch(version=5, timeout=5)
    s = run.status()
    assert s["auth/role_refused"] == before["auth/role_refused"] + 2
    assert s["learner_version"] == before["learner_version"] and run.proc.poll() is None
    # negative control, last: the driver's stop is obeyed
    with dealer(run.serve, curve=run.role("driver"), linger=0) as driver:
        assert isinstance(driver.request(Control(command="stop", reason="run end"), timeout=5), (Ack, Metrics))
    run.proc.wait(15)
