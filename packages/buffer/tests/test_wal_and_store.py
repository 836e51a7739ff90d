"""The write-ahead log and the state machine, without processes."""

from __future__ import annotations

import msgspec

from tidal.buffer import wal
from tidal.buffer.batching import split_groups
from tidal.buffer.store import Store, encode_trajectory, num_tokens
from tidal.core.testing import make_trajectory


def traj(i: int, group: str = "g0", n: int = 16):
    t = make_trajectory(i, completion_len=n)
    t.group_id = group
    return t


def test_records_survive_a_round_trip(tmp_path):
    log = wal.WriteAheadLog(tmp_path)
    log.replay()
    recs = [wal.Put(encode_trajectory(traj(0))), wal.Serve("b0-r0", 0, 1, ["traj-0"]), wal.Consume("b0-r0"),
            wal.Drop(["x"], "stale"), wal.Release("g")]
    for r in recs:
        log.append(r)
    log.close()
    again, report = wal.WriteAheadLog(tmp_path).replay()
    assert again == recs and report.corrupt_bytes == 0


def test_corruption_in_the_middle_is_skipped_and_later_records_recovered(tmp_path):
    log = wal.WriteAheadLog(tmp_path)
    log.replay()
    for i in range(5):
        log.append(wal.Drop([f"id{i}"], "x"))
    log.close()
    seg = log.segments()[0]
    data = bytearray(seg.read_bytes())
    size = len(wal.encode_record(wal.Drop(["id0"], "x")))
    data[2 * size + 9] ^= 0xFF  # flip a payload byte of the third record
    seg.write_bytes(bytes(data))
    recs, report = wal.WriteAheadLog(tmp_path).replay()
    assert [r.ids[0] for r in recs] == ["id0", "id1", "id3", "id4"]
    assert report.corrupt_regions == [(seg.name, 2 * size, size)]


def test_torn_tail_is_truncated_before_appending(tmp_path):
    log = wal.WriteAheadLog(tmp_path)
    log.replay()
    log.append(wal.Drop(["a"], "x"))
    log.close()
    seg = log.segments()[0]
    with open(seg, "ab") as f:
        f.write(wal.encode_record(wal.Drop(["b"], "x"))[:-3])  # crash mid-write
    log2 = wal.WriteAheadLog(tmp_path)
    recs, report = log2.replay()
    assert [r.ids for r in recs] == [["a"]] and report.corrupt_bytes > 0
    log2.append(wal.Drop(["c"], "x"))
    log2.close()
    recs, report = wal.WriteAheadLog(tmp_path).replay()
    assert [r.ids for r in recs] == [["a"], ["c"]] and report.corrupt_bytes == 0


def test_compaction_replaces_history_with_a_snapshot(tmp_path):
    log = wal.WriteAheadLog(tmp_path)
    log.replay()
    store = Store(group_size=2)
    for i in range(4):
        t = traj(i, group=f"g{i // 2}")
        log.append(wal.Put(encode_trajectory(t)))
        store.put(t)
    store.serve("b0-r0", 0, 1, ["traj-0", "traj-1"])
    store.consume("b0-r0")
    store.serve("b1-r0", 0, 1, ["traj-2", "traj-3"])
    log.compact(store.snapshot())
    (tmp_path / "wal-00000099.log.tmp").write_bytes(b"half a compaction")
    log.close()
    assert len(log.segments()) == 1
    recs, _ = wal.WriteAheadLog(tmp_path).replay()
    assert not list(tmp_path.glob("*.tmp"))
    again = Store(group_size=2)
    for r in recs:
        again.apply(r)
    assert list(again.outstanding) == ["b1-r0"] and again.known("traj-0") and not again.ready
    assert again.next_batch_seq == 2


def test_groups_are_ready_only_when_complete():
    store = Store(group_size=3)
    assert store.put(traj(0)) is None and store.put(traj(1)) is None
    assert not store.ready
    assert store.put(traj(1)) is None and store.stats["duplicates"] == 1
    assert store.put(traj(2)) is not None and list(store.ready) == ["g0"]


def test_a_dropped_trajectory_resent_is_a_duplicate_not_a_new_member():
    """A group dropped by a filter whose acks were lost is resent whole or in part: it must neither be
    filtered (and counted) again nor leave half a group waiting for the group timeout."""
    store = Store(group_size=2)
    store.put(traj(0))
    store.put(traj(1))
    store.drop([traj(0).id, traj(1).id], "filter:zero_variance")
    assert store.put(traj(1)) is None and store.put(traj(0)) is None
    assert store.stats["duplicates"] == 2 and not store.assembling and not store.ready
    assert store.drops == {"filter:zero_variance": 2}


def test_lpt_split_balances_tokens_by_whole_groups():
    groups = []
    for i, n in enumerate([100, 90, 50, 40, 30, 10]):
        store = Store(1)
        g = store.put(traj(i, group=f"g{i}", n=n))  # completes its group of one
        assert g.tokens == sum(num_tokens(t) for t in g.members.values())
        groups.append(g)
    shares = split_groups(groups, 2)
    loads = [sum(g.tokens for g in s) for s in shares]
    assert sorted(len(s) for s in shares) == [3, 3] and max(loads) - min(loads) <= 32 + 10


def test_put_records_are_written_as_msgspec_encodes_them(tmp_path):
    frames = [b"", b"a" * 255, b"b" * 256, b"c" * 65_535, b"d" * 65_536, b"e" * 200_000]
    for f in frames:
        assert wal._put_prefix(len(f)) + f == msgspec.msgpack.encode(wal.Put(f))
    log = wal.WriteAheadLog(tmp_path)
    for f in frames:
        log.append(wal.Put(f))
    log.append(wal.Consume("b0-r0"))
    log.close()
    # byte for byte what the general path writes (header, checksum, msgspec's encoding)
    expected = b"".join(wal.encode_record(r) for r in (*(wal.Put(f) for f in frames), wal.Consume("b0-r0")))
    assert b"".join(p.read_bytes() for p in log.segments()) == expected
    recs, report = wal.WriteAheadLog(tmp_path).replay()
    assert recs == [*(wal.Put(f) for f in frames), wal.Consume("b0-r0")] and not report.corrupt_regions


def test_group_records_are_written_as_msgspec_encodes_them_and_replay_every_member(tmp_path):
    from tidal.buffer.store import PREAMBLE, body_of, frame_of

    for n in (1, 3, 15, 16, 40):  # fixarray and array16 headers
        frames = [encode_trajectory(traj(i, group=f"g{n}", n=i % 5)) for i in range(n)]
        log = wal.WriteAheadLog(tmp_path / str(n))
        log.append_group([body_of(f) for f in frames], PREAMBLE)  # views, as the service passes them
        log.close()
        assert b"".join(p.read_bytes() for p in log.segments()) == wal.encode_record(wal.PutGroup(frames))
        recs, report = wal.WriteAheadLog(tmp_path / str(n)).replay()
        assert recs == [wal.PutGroup(frames)] and not report.corrupt_regions
        store = Store(group_size=n)
        store.apply(recs[0])
        assert list(store.ready) == [f"g{n}"] and store.stats["accepted"] == n
        assert [frame_of(store.frames[f"traj-{i}"]) for i in range(n)] == frames


def test_a_group_message_is_logged_as_it_came_and_replays_every_member_as_a_sample(tmp_path):
    from tidal.buffer.store import VIEW_AT_LEAST, ArrayBytes, ArrayView, body_of, frame_of
    from tidal.core.codec import Codec
    from tidal.core.protocol import TrajectoryGroup

    for n in (1, 8, 20):
        members = [traj(i, group=f"g{n}", n=i % 5 + 1 if n != 8 else 2000) for i in range(n)]  # 8: large ones
        frame = bytes(Codec(inline_threshold=1 << 62).encode(TrajectoryGroup(id=f"g{n}", trajectories=members))[0])
        assert wal._message_prefix(len(frame)) + frame == msgspec.msgpack.encode(wal.PutMessage(frame))
        log = wal.WriteAheadLog(tmp_path / str(n))
        log.append_message(memoryview(frame))  # a view of the received message, as the service passes it
        log.close()
        assert b"".join(p.read_bytes() for p in log.segments()) == wal.encode_record(wal.PutMessage(frame))
        recs, report = wal.WriteAheadLog(tmp_path / str(n)).replay()
        assert recs == [wal.PutMessage(frame)] and not report.corrupt_regions
        store = Store(group_size=n)
        store.apply(recs[0])
        assert list(store.ready) == [f"g{n}"] and store.stats["accepted"] == n
        assert [frame_of(store.frames[t.id]) for t in members] == [encode_trajectory(t) for t in members]
        held = store.ready[f"g{n}"].members
        for tid, s in held.items():  # a large member's arrays are views into the record, not copies
            assert type(s.logprobs) is (ArrayView if len(store.frames[tid]) >= VIEW_AT_LEAST else ArrayBytes)
        assert (n == 8) == (type(held["traj-0"].logprobs) is ArrayView)
        assert [s.logprobs.numpy().tolist() for s in held.values()] == [t.logprobs.tolist() for t in members]
        assert store.ready[f"g{n}"].tokens == sum(num_tokens(t) for t in members)
        assert body_of(frame_of(store.frames["traj-0"])).tobytes() == bytes(store.frames["traj-0"])
