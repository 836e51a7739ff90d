"""Bad input raises ProtocolError that says what was wrong and names the field."""

from __future__ import annotations

import msgspec
import pytest

from tidal.core import Codec, ProtocolError, ProtocolVersionError
from tidal.core.protocol import PROTOCOL_VERSION, Ack
from tidal.core.testing import make_trajectory

CODEC = Codec()


def _frames_with_header(header_obj, frames):
    return [bytes(frames[0][:4]) + msgspec.msgpack.encode(header_obj), *frames[1:]]


def _traj_frames():
    # every array out of line, so frame errors are reachable
    frames = CODEC.encode(make_trajectory(0, out_of_line=True))
    return frames, msgspec.msgpack.decode(bytes(frames[0][4:]))


def test_wrong_typed_field_is_named():
    frames, header = _traj_frames()
    header[9] = "lots"  # reward must be a float
    with pytest.raises(ProtocolError, match=r"Trajectory\.reward.*Expected `float`, got `str`") as e:
        CODEC.decode(_frames_with_header(header, frames))
    assert e.value.field == "Trajectory.reward"


def test_unknown_message_type_is_named():
    frames, header = _traj_frames()
    header[0] = "Teleport"
    with pytest.raises(ProtocolError, match="message type") as e:
        CODEC.decode(_frames_with_header(header, frames))
    assert e.value.field == "message type"


def test_a_single_type_codec_names_what_it_takes_and_what_came():
    from tidal.core.protocol import Ack, Trajectory

    narrow = Codec(message_type=Trajectory)
    assert narrow.decode([bytes(f) for f in narrow.encode(make_trajectory(0))]) == make_trajectory(0)
    with pytest.raises(ProtocolError, match="takes Trajectory messages, not Ack") as e:
        narrow.decode([bytes(CODEC.encode(Ack(kind="x", ids=["a"]))[0])])
    assert e.value.field == "message type"


@pytest.mark.parametrize("tag", [["Ack", "trajectory", ["a", "b"]], {"Ack": 1}, 7, None])
def test_a_tag_that_is_not_a_name_is_a_protocol_error(tag):
    """Found by the live fuzz test: a header whose type tag is a list or a map (unhashable) must be
    refused like any other bad header, not raise a TypeError out of the error path."""
    header = msgspec.msgpack.decode(bytes(CODEC.encode(Ack(kind="x", ids=["a"]))[0][4:]))
    header[0] = tag
    with pytest.raises(ProtocolError, match="message type"):
        CODEC.decode(_frames_with_header(header, CODEC.encode(Ack(kind="x", ids=["a"]))))


def test_missing_required_fields_are_reported():
    frames, header = _traj_frames()
    with pytest.raises(ProtocolError, match="Expected `array` of at least length"):
        CODEC.decode(_frames_with_header(header[:5], frames))


@pytest.mark.parametrize(
    ("mutate", "needle", "field"),
    [
        (lambda h: h[5].__setitem__(0, "int99"), "Invalid enum value 'int99'", "Trajectory.prompt_ids.dtype"),
        (lambda h: h[6].__setitem__(1, [-1]), "Expected `int` >= 0", "Trajectory.completion_ids.shape[0]"),
        (lambda h: h[6].__setitem__(1, [1] * 40), "length <= 32", "Trajectory.completion_ids.shape"),
        (lambda h: h[6].__setitem__(1, [10**6]), "do not fit dtype", "Trajectory.completion_ids"),
        (lambda h: h[7].__setitem__(2, 99), "refers to frame 99", "Trajectory.logprobs"),
        (lambda h: h[8].__setitem__(2, 0), "referenced twice", "Trajectory.versions"),
        (lambda h: h.__setitem__(7, "no"), "Expected `array`, got `str`", "Trajectory.logprobs"),
    ],
)
def test_bad_array_headers_name_the_array(mutate, needle, field):
    frames, header = _traj_frames()
    mutate(header)
    with pytest.raises(ProtocolError, match=needle) as e:
        CODEC.decode(_frames_with_header(header, frames))
    assert e.value.field == field


def test_nested_field_paths_go_through_lists():
    from tidal.core.protocol import Batch

    frames = CODEC.encode(Batch(batch_id="b", rank=0, world_size=1,
                                trajectories=[make_trajectory(i, out_of_line=True) for i in range(3)]))
    header = msgspec.msgpack.decode(bytes(frames[0][4:]))
    header[4][2][3] = 5  # trajectories[2].sample_index fine; make task (index 4) wrong instead
    header[4][2][4] = 5
    with pytest.raises(ProtocolError) as e:
        CODEC.decode(_frames_with_header(header, frames))
    assert e.value.field == "Batch.trajectories[2].task"


def test_truncated_header_and_missing_frames():
    frames, _ = _traj_frames()
    with pytest.raises(ProtocolError, match="truncated"):
        CODEC.decode([frames[0][:20], *frames[1:]])
    with pytest.raises(ProtocolError, match="refers to frame"):
        CODEC.decode(frames[:-1])
    with pytest.raises(ProtocolError, match="not referenced"):
        CODEC.decode([*frames, b"extra"])
    with pytest.raises(ProtocolError, match="no frames"):
        CODEC.decode([])


def test_not_a_tidal_message():
    with pytest.raises(ProtocolError, match="preamble"):
        CODEC.decode([b"GET / HTTP/1.1\r\n"])
    with pytest.raises(ProtocolError, match="preamble"):
        CODEC.decode([b"\xd7"])


def test_oversized_messages_are_refused_before_decoding():
    small = Codec(max_message_bytes=1000, max_header_bytes=150, max_frames=3)
    frames = Codec().encode(make_trajectory(0, completion_len=1000, out_of_line=True))
    with pytest.raises(ProtocolError, match="limit is 3"):
        small.decode(frames)
    with pytest.raises(ProtocolError, match=r"bytes; limit is 1000"):
        small.decode([*frames[:1], b"x" * 2000])
    with pytest.raises(ProtocolError, match="header is .* limit is 150"):
        small.decode([frames[0][:4] + b"\x00" * 200])


def test_other_major_version_is_refused_naming_both():
    future = Codec(protocol=(2, 3))
    frames = future.encode(make_trajectory(0, out_of_line=True))
    ours = r"\.".join(map(str, PROTOCOL_VERSION))
    with pytest.raises(ProtocolVersionError, match=rf"peer speaks Tidal protocol 2\.3, this process speaks {ours}"):
        CODEC.decode(frames)


def test_other_minor_version_is_accepted():
    newer_minor = Codec(protocol=(1, 7))
    assert CODEC.decode(newer_minor.encode(make_trajectory(0))) == make_trajectory(0)


def test_codec_is_usable_after_errors():
    good = CODEC.encode(make_trajectory(1, out_of_line=True))
    for bad in ([b"junk"], [good[0][:10]], good[:1]):
        with pytest.raises(ProtocolError):
            CODEC.decode(bad)
        assert CODEC.decode(good) == make_trajectory(1)


def test_a_bad_member_of_a_group_is_named_through_the_group():
    from tidal.core.protocol import Trajectory, TrajectoryGroup
    from tidal.core.testing import make_group

    ingest = Codec(message_type=Trajectory | TrajectoryGroup)  # what the buffer's ingest decodes
    frames = ingest.encode(make_group("g", 3, out_of_line=True))
    header = msgspec.msgpack.decode(bytes(frames[0][4:]))
    header[2][1][7] = "no"  # trajectories[1].logprobs
    with pytest.raises(ProtocolError, match="Expected `array`, got `str`") as e:
        ingest.decode(_frames_with_header(header, frames))
    assert e.value.field == "TrajectoryGroup.trajectories[1].logprobs"
    assert ingest.decode(frames) == make_group("g", 3)  # the codec goes on
