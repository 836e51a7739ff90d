"""10,000+ random, truncated and mutated frames thrown at a live receiver process: each one is either a
valid message or a ProtocolError, never anything else, and the receiver keeps serving throughout."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.core import Codec, ProtocolError
from tidal.core.channels import dealer
from tidal.core.protocol import Ack, Control, Error, Hello
from tidal.core.testing import make_trajectory, sample_messages

EXAMPLES = int(os.environ.get("TIDAL_FUZZ_EXAMPLES", "10000"))
CODEC = Codec()
# inline and out-of-line variants, so that data frames are in play
VALID = [CODEC.encode(m) for ool in (False, True) for m in sample_messages(out_of_line=ool) if type(m) is not Control]
VALID = [[bytes(f) for f in frames] for frames in VALID]


@st.composite
def hostile_frames(draw) -> list[bytes]:
    kind = draw(st.sampled_from(["random", "truncate", "mutate", "splice", "frames"]))
    base = draw(st.sampled_from(VALID))
    if kind == "random":
        return draw(st.lists(st.binary(max_size=300), min_size=1, max_size=4))
    if kind == "truncate":
        i = draw(st.integers(0, len(base) - 1))
        cut = draw(st.integers(0, max(0, len(base[i]) - 1)))
        return [*base[:i], base[i][:cut], *base[i + 1 :]]
    if kind == "mutate":
        frames = list(base)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(frames) - 1))
            if not frames[i]:
                continue
            pos = draw(st.integers(0, len(frames[i]) - 1))
            b = bytearray(frames[i])
            b[pos] = draw(st.integers(0, 255))
            frames[i] = bytes(b)
        return frames
    if kind == "splice":
        # a valid preamble followed by random msgpack-ish bytes
        return [base[0][:4] + draw(st.binary(max_size=200)), *draw(st.lists(st.binary(max_size=64), max_size=2))]
    # frames: drop or add data frames
    if len(base) > 1 and draw(st.booleans()):
        return base[:-1]
    return [*base, draw(st.binary(max_size=64))]


def _expect_valid(frames: list[bytes]) -> bool:
    try:
        msg = CODEC.decode(frames)
    except ProtocolError:
        return False
    # any other exception propagates and fails the test
    # A Hello whose body claims another major version is well-formed but refused at the handshake.
    return not (type(msg) is Hello and msg.protocol[0] != CODEC.protocol[0])


@pytest.mark.timeout(600)
def test_live_receiver_survives_hostile_frames(server_process):
    proc, endpoint = server_process()
    expected_errors = 0
    sent = 0
    with dealer(endpoint, linger=0) as client:

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(hostile_frames())
        def throw(frames: list[bytes]) -> None:
            nonlocal expected_errors, sent
            valid = _expect_valid(frames)
            client.socket.send_multipart(frames)
            sent += 1
            reply = client.recv(timeout=10)
            if valid:
                assert type(reply) in (Ack, Hello), reply
            else:
                expected_errors += 1
                assert type(reply) is Error and reply.code in ("protocol", "version"), reply
                assert reply.detail  # says what was wrong
            assert proc.poll() is None, "receiver died"

        throw()
        # It still serves a well-formed message after all of that.
        assert client.request(make_trajectory(5), timeout=10) == Ack(kind="echo", ids=["Trajectory"])
        stats = client.request(Control(command="stop", reason="bye"), timeout=10)
    assert sent >= EXAMPLES
    _ok, errors = (int(x) for x in stats.ids)
    assert errors == expected_errors
    assert expected_errors > EXAMPLES // 2  # the generator really is hostile
    assert proc.wait(timeout=10) == 0
