"""Trajectory groups as the unit of ingest, against real buffer processes: a group is logged, acknowledged
and served as one, exactly once across kill -9, with the same result as its trajectories sent singly."""

from __future__ import annotations

import random
import sys
import time
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
from audit import assert_exactly_once, read_ids


@pytest.mark.timeout(400)
def test_groups_and_lone_trajectories_survive_kill_9_exactly_once(buffer_process, producers, make_learners):
    G = 4
    buf = buffer_process(group_size=G, batch_samples=8, fsync="batch")
    files = [producers.start(buf, f"grp{i}", 320, G, resend_after=0.5, unit="group") for i in range(2)]
    files.append(producers.start(buf, "lone", 320, G, resend_after=0.5))  # mixing the units is fine
    learners = make_learners(buf.serve, world_size=1, group_size=G)
    rng = random.Random(11)
    try:
        for _ in range(3):  # kill at random moments, restart on the same log and ports
            time.sleep(rng.uniform(0.5, 2.0))
            buf.kill9()
            time.sleep(rng.uniform(0.0, 0.5))
            buf.start()
        producers.wait(timeout=300)
        acked = read_ids(*files)
        assert len(acked) == 960
        learners.wait_for(960, timeout=120)
    finally:
        learners.stop()
    assert not learners.errors, learners.errors
    assert_exactly_once(acked, learners.trained)
    assert not learners.incomplete_groups
    assert "replayed" in buf.log_text()


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
