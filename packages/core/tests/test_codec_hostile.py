"""Hostile bytes cost a receiver one counted ProtocolError, never its life, its memory or its stack:
deeply nested bodies, exceptions of any type from the decoder, headers built to amplify on the error
path, and frames over the socket's size limit."""

from __future__ import annotations

import tracemalloc

import pytest
import zmq

from tidal.core import Codec, ProtocolError
from tidal.core.channels import max_frame_bytes, pull, push, router
from tidal.core.codec import MAGIC, PREAMBLE_BYTES
from tidal.core.protocol import PROTOCOL_VERSION, Heartbeat, Metrics, Trajectory, TrajectoryGroup
from tidal.core.testing import make_trajectory

PRE = MAGIC + bytes(PROTOCOL_VERSION)
LOCAL = "tcp://127.0.0.1:*"


def _nested(depth: int, tag: bytes = b"") -> bytes:
    head = b"\x92\xa7" + tag if tag else b""
    return PRE + head + b"\x91" * depth + b"\xc0"


@pytest.mark.parametrize("codec", [Codec(), Codec(message_type=Trajectory | TrajectoryGroup)], ids=["any", "narrow"])
@pytest.mark.parametrize("tag", [b"", b"Metrics"])
def test_a_200_kb_deeply_nested_body_is_a_protocol_error_and_the_codec_lives(codec, tag):
    with pytest.raises(ProtocolError):
        codec.decode([_nested(200_000, tag)])
    t = make_trajectory(1)
    assert codec.decode(Codec().encode(t)) == t  # the next message decodes


@pytest.mark.parametrize("exc", [RecursionError("deep"), MemoryError(), ValueError("v"), OverflowError("o"),
                                 KeyError("k"), RuntimeError("hook")])
def test_any_exception_from_the_decoder_becomes_a_protocol_error_naming_it(exc):
    class Exploding:
        def decode(self, body):
            raise exc

    codec = Codec()
    codec._decoder = Exploding()  # type: ignore[assignment]  # what msgspec or an Array hook might raise
    with pytest.raises(ProtocolError) as e:
        codec.decode(Codec().encode(Heartbeat(role="r", name="n", seq=0, time=0.0)))
    assert e.value.reason == "undecodable"
    assert ("nests too deeply" if isinstance(exc, RecursionError) else type(exc).__name__) in str(e.value)


def test_a_huge_header_with_an_early_error_costs_no_more_memory_than_itself():
    # a Heartbeat with a wrong-typed seq, then 8 MB of tiny arrays: an untyped decode of the whole body on the
    # error path made ~60 bytes of Python objects of each byte here (0.5 GB)
    n = 8_000_000
    frame = PRE + b"\x95\xa9Heartbeat\xa1r\xa1n\xa1x\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    codec = Codec(max_header_bytes=len(frame))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with pytest.raises(ProtocolError) as e:
            codec.decode([frame])
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert e.value.field == "Heartbeat.seq"  # still named
    assert peak < 1024**2, f"the error path allocated {peak / 1e6:.1f} MB for an {len(frame) / 1e6:.0f} MB header"


def test_a_tag_of_a_megabyte_is_not_echoed_back_whole():
    tag = b"X" * 1_000_000
    frame = PRE + b"\x92\xdb" + len(tag).to_bytes(4, "big") + tag + b"\xc0"
    with pytest.raises(ProtocolError) as e:
        Codec().decode([frame])
    assert len(str(e.value)) < 1000


def test_every_channel_sets_maxmsgsize_from_its_codec_limits():
    with pull(LOCAL) as default, pull(LOCAL, max_bytes=1024**2) as small:
        assert default.socket.getsockopt(zmq.MAXMSGSIZE) == max_frame_bytes(default.codec) < 1024**3
        assert small.socket.getsockopt(zmq.MAXMSGSIZE) == 1024**2 + PREAMBLE_BYTES
        assert small.codec.max_message_bytes == small.codec.max_header_bytes == 1024**2
    with pytest.raises(ValueError, match="not both"):
        pull(LOCAL, max_bytes=1, codec=Codec())


def test_a_frame_over_the_limit_is_dropped_unread_and_the_channel_keeps_working():
    big = Metrics(source="big", step=0, time=0.0, scalars={f"k{i}": 0.0 for i in range(40_000)})  # ~0.5 MB
    small = Heartbeat(role="r", name="after", seq=1, time=0.0)
    with pull(LOCAL, max_bytes=64 * 1024) as inbox, push(inbox.endpoint) as outbox:
        outbox.send(big, timeout=5)
        outbox.send(small, timeout=5)
        got = inbox.recv(timeout=10)  # libzmq dropped the big frame (and that connection); the push reconnected
        assert type(got) is Heartbeat and got.name == "after"
        with pytest.raises(zmq.error.Again):
            inbox.socket.recv(zmq.NOBLOCK)  # the big one never arrives


def test_a_router_drops_an_oversized_request_and_answers_the_next():
    with router(LOCAL, max_bytes=64 * 1024) as server:
        ctx = zmq.Context.instance()
        d = ctx.socket(zmq.DEALER)
        d.linger = 0
        try:
            d.connect(server.endpoint)
            d.send(PRE + b"\xc4" + b"\x00" * (1024**2))  # 1 MiB frame: over the limit
            d.send(Codec().encode(Heartbeat(role="r", name="ok", seq=0, time=0.0))[0])
            _, msg = server.recv(timeout=10)
            assert type(msg) is Heartbeat and msg.name == "ok"
        finally:
            d.close(0)
