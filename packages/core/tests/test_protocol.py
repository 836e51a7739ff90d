"""Every message survives a round trip; arrays keep dtype, shape and bytes, without copies."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from tidal.core import Array, Codec
from tidal.core.arrays import ITEMSIZE
from tidal.core.protocol import MESSAGE_TYPES, Batch, Metrics, Trajectory
from tidal.core.testing import make_trajectory, sample_messages


def test_sample_messages_cover_every_message_type():
    assert {type(m) for m in sample_messages()} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("out_of_line", [False, True], ids=["inline", "frames"])
def test_every_message_round_trips(out_of_line):
    codec = Codec()
    for msg in sample_messages(out_of_line=out_of_line):
        frames = codec.encode(msg)
        assert (len(frames) > 1) == (out_of_line and type(msg).__name__ in ("Metrics", "Assignment", "Trajectory", "TrajectoryGroup", "Batch", "WeightsBucket"))
        assert codec.decode([bytes(f) for f in frames]) == msg


def test_inline_codec_puts_everything_in_one_frame():
    codec = Codec(inline_threshold=1 << 62)
    for msg in sample_messages(out_of_line=True):
        frames = codec.encode(msg)
        assert len(frames) == 1 and codec.decode(frames) == msg


def test_every_message_field_has_a_comment():
    import inspect

    from tidal.core import protocol

    source = inspect.getsource(protocol)
    for typ in [*MESSAGE_TYPES, protocol.SamplingParams, protocol.TensorSpec]:
        body = inspect.getsource(typ)
        for field in msgspec.structs.fields(typ):
            line = next(ln for ln in body.splitlines() if ln.strip().startswith(f"{field.name}:"))
            idx = body.splitlines().index(line)
            above = body.splitlines()[idx - 1].strip()
            assert "#" in line or above.startswith("#"), f"{typ.__name__}.{field.name} has no comment"
    assert "pickle" not in source


@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (2, 3, 5), ()])
def test_arrays_keep_dtype_shape_and_bytes(dtype, shape):
    rng = np.random.default_rng(0)
    nbytes = int(np.prod(shape)) * ITEMSIZE[dtype]
    raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
    for out_of_line in (False, True):
        arr = Array.from_buffer(raw, dtype, shape, out_of_line=out_of_line)
        msg = Metrics(source="s", step=0, time=0.0, scalars={}, histograms={"x": arr})
        codec = Codec()
        out = codec.decode([bytes(f) for f in codec.encode(msg)]).histograms["x"]
        assert (out.dtype, out.shape, out.tobytes()) == (dtype, shape, raw.tobytes())


def test_numpy_view_matches_source_and_big_endian_is_normalised():
    src = np.arange(24, dtype=">f4").reshape(2, 3, 4)  # big-endian input
    arr = Array.from_numpy(src)
    assert arr.dtype == "float32" and arr.shape == (2, 3, 4)
    np.testing.assert_array_equal(arr.numpy(), src)
    with pytest.raises(TypeError, match="torch.frombuffer"):
        Array.from_buffer(b"\0\0", "bfloat16", (1,)).numpy()


def test_large_arrays_travel_as_separate_frames_without_copies():
    codec = Codec()
    big = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: out of line by default (>= 64 KiB)
    traj = make_trajectory(0)
    traj.completion_ids = Array.from_numpy(big.view(np.int32))
    frames = codec.encode(traj)
    assert len(frames) == 2  # header + the one large array; small ones inline
    # Encoding does not copy: the out-of-line frame is the caller's memory.
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), big)
    # Decoding does not copy either: the Array views the received frame.
    received = [bytes(frames[0]), bytearray(frames[1])]
    out = codec.decode(received)
    assert out.completion_ids.buffer.obj is received[1]
    assert out.completion_ids.out_of_line  # and it stays a frame if the message is sent on
    assert len(codec.encode(out)) == 2


def test_batch_of_many_trajectories_round_trips():
    codec = Codec()
    batch = Batch(batch_id="b", rank=0, world_size=1,
                  trajectories=[make_trajectory(i, rich=True, out_of_line=i % 2 == 0) for i in range(50)])
    frames = codec.encode(batch)
    assert len(frames) > 1
    assert codec.decode(frames) == batch


def test_array_rejects_inconsistent_construction():
    with pytest.raises(ValueError, match="expected 12"):
        Array.from_buffer(b"\0" * 8, "float32", (3,))
    with pytest.raises(ValueError, match="unknown dtype"):
        Array.from_buffer(b"", "complex64", (0,))
    with pytest.raises(ValueError, match="unknown dtype"):
        Array("complex64", (0,), b"")
    with pytest.raises(ValueError, match="C-contiguous"):
        Array.from_buffer(np.zeros((4, 4), np.float32)[:, 1], "float32", (4,))


def test_trajectory_fields_are_what_the_learner_needs():
    names = {f.name for f in msgspec.structs.fields(Trajectory)}
    assert {
        "prompt_ids", "completion_ids", "logprobs", "versions", "reward", "step_rewards", "group_id",
        "sample_index", "task", "finish_reason", "routing", "sampling_mask", "metadata",
    } <= names


def test_sampling_stop_strings_are_appended_so_an_older_peer_still_decodes():
    from tidal.core.protocol import SamplingParams

    class OldSamplingParams(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
        # SamplingParams as protocol 1.1 peers know it: everything before `stop`
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = -1
        max_tokens: int = 256
        stop_token_ids: list[int] = []
        ignore_eos: bool = False
        seed: int | None = None
        return_sampling_mask: bool = False
        return_routing: bool = False

    old = OldSamplingParams(temperature=0.5, stop_token_ids=[7], seed=3)
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=SamplingParams)
    assert new.stop == [] and new.stop_token_ids == [7] and new.seed == 3
    # and an old peer reads what a new one writes, ignoring the strings it does not know
    with_stop = msgspec.msgpack.encode(SamplingParams(temperature=0.5, stop=["Answer:"]))
    assert msgspec.msgpack.decode(with_stop, type=SamplingParams).stop == ["Answer:"]
    assert msgspec.msgpack.decode(with_stop, type=OldSamplingParams).temperature == 0.5


def test_kv_versions_round_trip_and_are_none_from_a_producer_that_does_not_record_them():
    # protocol 1.5: the field is appended with a default, so a 1.4 producer's trajectory (no field) decodes
    codec = Codec()
    kv = np.array([2, 2, -1, 3], np.int32)
    with_kv = msgspec.structs.replace(make_trajectory(0, completion_len=4), kv_versions=Array.from_numpy(kv))
    back = codec.decode([bytes(f) for f in codec.encode(with_kv)])
    assert isinstance(back, Trajectory) and back.kv_versions is not None
    assert back.kv_versions.numpy().tolist() == kv.tolist()
    plain = codec.decode([bytes(f) for f in codec.encode(make_trajectory(1, completion_len=4))])
    assert isinstance(plain, Trajectory) and plain.kv_versions is None
