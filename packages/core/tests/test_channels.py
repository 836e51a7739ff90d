"""Channels over real sockets: every pattern, timeouts, back-pressure, handshake, version refusal."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from tidal.core import (
    ChannelClosed,
    ChannelTimeout,
    Codec,
    ProtocolError,
    ProtocolVersionError,
    SecurityError,
)
from tidal.core.arrays import Array
from tidal.core.channels import dealer, make_hello, poll, pub, pull, push, router, sub
from tidal.core.protocol import PROTOCOL_VERSION, Ack, Control, Error, Metrics
from tidal.core.security import is_loopback
from tidal.core.testing import make_trajectory, sample_messages

LOCAL = "tcp://127.0.0.1:*"


def test_push_pull_carries_every_message_type():
    with pull(LOCAL) as inbox, push(inbox.endpoint) as outbox:
        for msg in sample_messages():
            outbox.send(msg, timeout=5)
            assert inbox.recv(timeout=5) == msg


def test_64_mib_array_arrives_zero_copy_with_dtype_and_shape():
    payload = np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32)  # 64 MiB
    msg = Metrics(source="s", step=0, time=0.0, scalars={}, histograms={"w": Array.from_numpy(payload)})
    # above the default limit for control traffic: a channel that takes large messages says so
    with pull(LOCAL, max_bytes=128 * 1024**2) as inbox, push(inbox.endpoint) as outbox:
        outbox.send(msg, timeout=10)
        got = inbox.recv(timeout=30).histograms["w"]
    assert got.dtype == "float32" and got.shape == (4096, 4096)
    assert isinstance(got.buffer.obj, zmq.Frame)  # a view of the received frame, not a copy
    np.testing.assert_array_equal(got.numpy(), payload)


def test_recv_times_out_instead_of_hanging():
    with pull(LOCAL) as inbox, pytest.raises(ChannelTimeout, match="within 0.05 s"):
        inbox.recv(timeout=0.05)


def test_default_recv_timeout_applies():
    with pull(LOCAL, recv_timeout=0.05) as inbox, pytest.raises(ChannelTimeout):
        inbox.recv()


def test_push_feels_back_pressure_at_the_high_water_mark():
    # Nobody reads: sends succeed until the HWMs fill, then time out instead of dropping.
    with pull(LOCAL, hwm=2) as inbox, push(inbox.endpoint, hwm=2, linger=0) as outbox:
        hb = make_trajectory(0, completion_len=100_000)  # ~1 MB: kernel buffers fill quickly too
        sent = 0
        with pytest.raises(ChannelTimeout, match="could not send"):
            for _ in range(10_000):
                outbox.send(hb, timeout=0.2)
                sent += 1
        assert sent < 10_000
        received = 0
        while True:
            try:
                inbox.recv(timeout=0.2)
                received += 1
            except ChannelTimeout:
                break
        assert received == sent  # everything accepted was delivered


def test_pull_survives_a_malformed_message_and_serves_the_next():
    with pull(LOCAL) as inbox, push(inbox.endpoint) as outbox:
        outbox.socket.send_multipart([b"not tidal"])
        outbox.send(make_trajectory(3))
        with pytest.raises(ProtocolError, match="preamble"):
            inbox.recv(timeout=5)
        assert inbox.recv(timeout=5) == make_trajectory(3)


def test_pub_sub_filters_by_topic():
    with pub(LOCAL) as out, sub(out.endpoint, topics=["metrics"]) as listener:
        msg = Metrics(source="l", step=1, time=0.0, scalars={"loss": 1.0})
        # PUB/SUB joins asynchronously: publish until the subscription has propagated.
        for _ in range(200):
            out.publish("control", Control(command="pause"))
            out.publish("metrics/learner", msg)
            try:
                topic, got = listener.recv(timeout=0.02)
                break
            except ChannelTimeout:
                continue
        else:
            pytest.fail("subscription never received anything")
        assert topic == "metrics/learner" and got == msg


def test_a_publisher_can_wait_for_its_first_subscriber():
    with pub(LOCAL, watch_subscriptions=True) as out:
        assert not out.wait_for_subscriber("metrics", 0.2)  # nobody yet
        with sub(out.endpoint, topics=["weights"]), sub(out.endpoint, topics=[""]):
            assert not out.wait_for_subscriber("metrics", 0.3)  # another topic; everything (not the one)
            with sub(out.endpoint, topics=["metrics"]) as listener:
                assert out.wait_for_subscriber("metrics", 10)
                msg = Metrics(source="l", step=1, time=0.0, scalars={"loss": 1.0})
                out.publish("metrics/learner", msg)  # the very first message arrives: no slow joiner
                assert listener.recv(timeout=10) == ("metrics/learner", msg)
    with pub(LOCAL) as plain, pytest.raises(ValueError, match="watch_subscriptions"):
        plain.wait_for_subscriber("metrics", 0.1)


def test_router_dealer_handshake_and_request_reply():
    with router(LOCAL, hello=make_hello("buffer", "buffer-0")) as server, dealer(server.endpoint) as client:
        def serve_one():
            peer, msg = server.recv(timeout=5)
            server.send(peer, Ack(kind="echo", ids=[type(msg).__name__]))

        t = threading.Thread(target=serve_one)
        t.start()
        info = client.handshake(make_hello("learner", "learner-0"), timeout=5)
        assert (info.role, info.name) == ("buffer", "buffer-0")
        assert client.request(make_trajectory(0), timeout=5) == Ack(kind="echo", ids=["Trajectory"])
        t.join(5)
        assert [h.name for h in server.peers.values()] == ["learner-0"]


def test_router_answers_garbage_with_an_error_and_keeps_serving():
    with router(LOCAL) as server, dealer(server.endpoint) as client:
        client.socket.send_multipart([b"\xd7T\x01\x00\xff\xff"])
        with pytest.raises(ProtocolError) as e:
            server.recv(timeout=5)
        assert e.value.peer is not None
        reply = client.recv(timeout=5)
        assert type(reply) is Error and reply.code == "protocol" and "Expected `array`, got `int`" in reply.detail
        client.send(Control(command="status"))
        _peer, msg = server.recv(timeout=5)
        assert msg == Control(command="status")


def test_peer_of_another_major_version_is_refused_at_hello(server_process):
    proc, endpoint = server_process()
    future = Codec(protocol=(2, 0))
    with dealer(endpoint, codec=future) as client:
        hello = make_hello("rollout", "from-the-future")
        hello.protocol = (2, 0)
        ours = r"\.".join(map(str, PROTOCOL_VERSION))
        with pytest.raises(ProtocolVersionError, match=rf"peer speaks Tidal protocol {ours}, this process speaks 2\.0") as e:
            client.handshake(hello, timeout=5)
        assert e.value.ours == (2, 0) and e.value.theirs[0] == 1
    # the server is unharmed and still serves a current peer
    with dealer(endpoint) as client:
        assert client.handshake(make_hello("rollout", "current"), timeout=5).protocol[0] == 1
        assert client.request(make_trajectory(0), timeout=5) == Ack(kind="echo", ids=["Trajectory"])
        client.request(Control(command="stop", reason="bye"), timeout=5)
    assert proc.wait(timeout=10) == 0


def test_poll_reports_ready_channels():
    with pull(LOCAL) as a, pull(LOCAL) as b, push(b.endpoint) as to_b:
        assert poll([a, b], timeout=0.01) == []
        to_b.send(Control(command="resume"))
        assert poll([a, b], timeout=5) == [b]


def test_closed_channel_refuses_use():
    ch = pull(LOCAL)
    ch.close()
    with pytest.raises(ChannelClosed):
        ch.recv(timeout=0.01)


def test_non_loopback_endpoints_require_curve():
    with pytest.raises(SecurityError, match="not loopback.*CURVE"):
        pull("tcp://*:5999")
    with pytest.raises(SecurityError):
        push("tcp://10.1.2.3:5999")
    assert is_loopback("tcp://127.0.0.1:1") and is_loopback("tcp://[::1]:1") and is_loopback("tcp://localhost:1")
    assert is_loopback("ipc:///tmp/x") and is_loopback("inproc://x")
    assert not is_loopback("tcp://0.0.0.0:1") and not is_loopback("tcp://example.org:1")


def test_sending_to_a_peer_that_left_names_it_and_keeps_the_error_that_led_there():
    """A router send to a peer that has gone raises PeerUnreachable. Sent from cleanup code (`finally`),
    the traceback still carries the exception that led to the cleanup."""
    from tidal.core.errors import PeerUnreachable

    with router(LOCAL, hello=make_hello("controller", "c")) as server:
        with dealer(server.endpoint, identity=b"worker-1", linger=0) as client:
            client.send(Control(command="status"))
            peer, _ = server.recv(timeout=5)
        assert peer == b"worker-1"
        deadline = time.monotonic() + 5
        with pytest.raises(PeerUnreachable, match="worker-1") as e:
            try:
                raise RuntimeError("the run failed first")
            finally:
                while True:  # the router learns of the disconnect asynchronously
                    server.send(peer, Control(command="stop"), timeout=1)
                    assert time.monotonic() < deadline, "the router never saw the peer leave"
                    time.sleep(0.01)
        assert isinstance(e.value.__context__, RuntimeError) and not e.value.__suppress_context__


def test_a_waker_ends_a_poll_at_once_from_another_thread_and_is_cleared_by_it():
    from tidal.core.channels import Waker

    waker = Waker()
    with pull("tcp://127.0.0.1:*") as inbox:
        timer = threading.Timer(0.1, waker.wake)
        timer.start()
        t0 = time.monotonic()
        assert poll([inbox], timeout=10, waker=waker) == []  # woken, no message
        assert time.monotonic() - t0 < 5
        timer.join()
        for _ in range(3):  # several wakes before the poll: one poll clears them all
            waker.wake()
        assert poll([inbox], timeout=0, waker=waker) == []
        t0 = time.monotonic()
        assert poll([inbox], timeout=0.2, waker=waker) == []  # cleared: this one waits its timeout
        assert time.monotonic() - t0 >= 0.15
    waker.close()
    waker.wake()  # closed: a late wake from a thread still running is harmless
