"""Trajectory groups as the unit of ingest, against real buffer processes: a group is logged, acknowledged
and served as one, exactly once across kill -9, with the same result as its trajectories sent singly."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from tidal.buffer.client import BatchClient
from tidal.core.channels import push
from tidal.core.codec import Codec
from tidal.core.protocol import Trajectory
from tidal.core.reliable import AckedPusher
from tidal.core.testing import make_group

sys.path.insert(0, str(Path(__file__).parent))
from audit import kill_9_drill


@pytest.mark.timeout(400)
def test_groups_and_lone_trajectories_survive_kill_9_exactly_once(buffer_process, producers, make_learners):
    buf = buffer_process(group_size=4, batch_samples=8, fsync="batch")
    # mixing the units is fine: two group producers and one of lone trajectories
    kill_9_drill(buf, producers, make_learners, ["group", "group", "trajectory"], kills=3, seed=11)


def _served(buf, n: int) -> list[list[Trajectory]]:
    out: list[list[Trajectory]] = []
    with BatchClient(buf.serve, retry_every=0.5) as learner:
        while sum(map(len, out)) < n:
            batch = learner.next_batch(0, timeout=30)
            out.append(batch.trajectories)
            learner.ack(batch.batch_id)
    return out


@pytest.mark.timeout(120)
def test_a_group_and_its_trajectories_sent_singly_are_served_the_same(buffer_process, tmp_path):
    groups = [make_group(f"g{i}", 4, source="w", seed=10 * i) for i in range(6)]
    served = {}
    for unit in ("group", "trajectory"):
        buf = buffer_process(group_size=4, batch_samples=8, wal_dir=str(tmp_path / unit))
        with AckedPusher(buf.ingest, buf.publish, "w", resend_after=0.5) as out:
            out.send(groups[5].trajectories[1])  # a lone trajectory first: its group resends it
            out.flush(timeout=30)
            for g in groups:
                for m in [g] if unit == "group" else g.trajectories:
                    out.send(m)
                out.flush(timeout=30)  # one at a time: groups complete in the same order both ways
            assert out.acked == 25 and not out.rejected
        served[unit] = _served(buf, 24)
        with BatchClient(buf.serve) as probe:
            s = probe.status(timeout=10).scalars
        assert s["total/accepted"] == 24 and s["total/duplicates"] == 1
        buf.stop()
    assert served["group"] == served["trajectory"]  # same batches, same members, same bytes
    assert [len(b) for b in served["group"]] == [8, 8, 8]


@pytest.mark.timeout(120)
def test_malformed_and_invalid_groups_are_refused_and_the_buffer_goes_on(buffer_process):
    buf = buffer_process(group_size=2, batch_samples=2)
    codec = Codec()
    frames = codec.encode(make_group("bad", 2, source="w"))
    header = msgspec.msgpack.decode(bytes(frames[0][4:]))
    header[2][1][7] = "no"  # trajectories[1].logprobs is not an array
    with push(buf.ingest) as rogue:
        rogue.socket.send_multipart([bytes(frames[0][:4]) + msgspec.msgpack.encode(header)])
    invalid = make_group("inv", 2, source="w")
    invalid.trajectories[1].versions = invalid.trajectories[0].prompt_ids  # wrong length: invalid, well-typed
    with AckedPusher(buf.ingest, buf.publish, "w", resend_after=0.5) as out:
        out.send(invalid)
        out.send(make_group("ok", 2, source="w"))
        out.flush(timeout=30)
        assert set(out.rejected) == {"inv:0", "inv:1"}  # refused whole, with the member named
        assert "invalid group inv: trajectories[1] (inv:1): versions has shape" in out.rejected["inv:0"]
        assert out.acked == 2
    assert [t.id for t in _served(buf, 2)[0]] == ["ok:0", "ok:1"]
    with BatchClient(buf.serve) as probe:
        s = probe.status(timeout=10).scalars
    assert s["errors/protocol"] == 1 and s["total/rejected"] == 1 and s["total/accepted"] == 2
    assert "TrajectoryGroup.trajectories[1].logprobs" in buf.log_text()
    assert buf.proc.poll() is None


@pytest.mark.timeout(120)
def test_a_member_whose_bytes_do_not_fit_its_shape_is_refused_with_the_array_named(buffer_process):
    # the buffer reads members without copying their arrays; the byte count an Array checks when it is
    # decoded is checked at admission instead, so nothing is served that a learner cannot decode
    buf = buffer_process(group_size=2, batch_samples=2)
    short = make_group("short", 2, source="w")
    lp = short.trajectories[1].logprobs
    lp.data = bytes(lp.buffer)[:-4]  # one float short of its shape (set after the Array checked itself)
    lone = make_group("lone", 2, source="w").trajectories[0]
    lone.versions.data = bytes(lone.versions.buffer) + b"\0\0\0\0"
    with AckedPusher(buf.ingest, buf.publish, "w", resend_after=0.5) as out:
        out.send(short)
        out.send(lone)
        out.send(make_group("ok", 2, source="w"))
        out.flush(timeout=30)
        assert set(out.rejected) == {"short:0", "short:1", "lone:0"}
        assert "trajectories[1] (short:1): logprobs has" in out.rejected["short:0"]
        assert "versions has" in out.rejected["lone:0"] and "need" in out.rejected["lone:0"]
    assert [t.id for t in _served(buf, 2)[0]] == ["ok:0", "ok:1"]
    assert buf.proc.poll() is None
