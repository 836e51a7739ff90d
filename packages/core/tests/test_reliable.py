"""AckedPusher with the test as its receiver (a real PULL and PUB on loopback): resends until acked,
and a TrajectoryGroup acknowledged under its group id is reported per trajectory id."""

from __future__ import annotations

import time

from tidal.core.channels import pub, pull
from tidal.core.errors import ChannelTimeout
from tidal.core.protocol import Ack, TrajectoryGroup
from tidal.core.reliable import AckedPusher, ack_topic
from tidal.core.testing import make_group, make_trajectory


def _settled(pusher: AckedPusher, out: pub, ack: Ack, timeout: float = 10) -> list[str]:
    """Publish `ack` until the pusher has processed it (its SUB joins late); the ids it reported."""
    done: list[str] = []
    deadline = time.monotonic() + timeout
    before = len(pusher.pending)
    while len(pusher.pending) == before and time.monotonic() < deadline:
        out.publish(ack_topic(pusher.name), ack)
        done += pusher.poll(timeout=0.05)
    assert len(pusher.pending) < before, "the ack never arrived"
    return done


def test_a_group_is_one_message_resent_until_acked_and_settled_per_trajectory():
    with pull("tcp://127.0.0.1:*") as inbox, pub("tcp://127.0.0.1:*") as acks:
        reported: list[list[str]] = []
        with AckedPusher(inbox.endpoint, acks.endpoint, "w0", resend_after=0.2, on_ack=reported.append) as p:
            group = make_group("g0", 4, source="w0", out_of_line=True)  # arrays as zero-copy frames
            p.send(group)
            p.send(make_trajectory(9))  # a lone trajectory beside it
            first = inbox.recv(timeout=5)
            assert type(first) is TrajectoryGroup and first == group and first.trajectories[2].logprobs.out_of_line
            assert inbox.recv(timeout=5) == make_trajectory(9)
            deadline = time.monotonic() + 5
            while p.resent == 0:  # not acked yet: sent again once resend_after has passed
                assert time.monotonic() < deadline, "the unacknowledged group was never resent"
                p.poll(0.05)
            assert inbox.recv(timeout=5) == group
            done = _settled(p, acks, Ack(kind="group", ids=["g0"], refused={"g0:3": "stale"}))
            assert sorted(done) == ["g0:0", "g0:1", "g0:2"] and reported[-1] == done
            assert p.rejected == {"g0:3": "stale"} and p.acked == 3 and list(p.pending) == ["traj-9"]
            _settled(p, acks, Ack(kind="trajectory", ids=["traj-9"]))
            p.send(make_group("g1", 2, source="w0"))
            inbox.recv(timeout=5)
            assert _settled(p, acks, Ack(kind="group", ids=["g1"], ok=False, detail="invalid group g1: x")) == []
            assert p.rejected["g1:0"] == p.rejected["g1:1"] == "invalid group g1: x" and p.acked == 4
            p.flush(timeout=1)  # nothing pending: returns at once
            _drain(inbox)  # resends that left before the acks arrived
            time.sleep(0.3)
            p.poll(0)
            assert _drain(inbox) == 0  # nothing is resent once settled


def _drain(inbox) -> int:
    n = 0
    while True:
        try:
            inbox.recv(timeout=0.1)
        except ChannelTimeout:
            return n
        n += 1
