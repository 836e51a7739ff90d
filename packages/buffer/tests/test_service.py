"""The buffer service as a real process with real sockets: producers and learners in other processes
and threads, kill -9 and restarts, back-pressure, malformed input, corrupted logs."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tidal.buffer.client import BatchClient
from tidal.core.channels import push

sys.path.insert(0, str(Path(__file__).parent))
from audit import assert_exactly_once, kill_9_drill, read_ids


@pytest.mark.timeout(300)
def test_many_producers_two_learner_ranks_exactly_once(buffer_process, producers, make_learners):
    G = 4
    buf = buffer_process(group_size=G, batch_samples=16)
    files = [producers.start(buf, f"w{i}", 200, G) for i in range(4)]
    learners = make_learners(buf.serve, world_size=2, group_size=G)
    try:
        producers.wait(timeout=240)
        acked = read_ids(*files)
        assert len(acked) == 800
        learners.wait_for(800, timeout=120)
    finally:
        learners.stop()
    assert not learners.errors, learners.errors
    assert_exactly_once(acked, learners.trained)
    assert not learners.incomplete_groups  # groups are released whole, never split
    assert {rank for rank, _, _ in learners.batches} == {0, 1}


@pytest.mark.timeout(400)
def test_kill_9_of_the_buffer_loses_nothing_and_duplicates_nothing(buffer_process, producers, make_learners):
    buf = buffer_process(group_size=4, batch_samples=8, fsync="batch")
    kill_9_drill(buf, producers, make_learners, ["trajectory"] * 3, kills=4, seed=7)  # 960: whole steps of 8


@pytest.mark.timeout(300)
def test_back_pressure_bounds_memory_and_loses_nothing(buffer_process, producers, make_learners):
    G, max_groups = 2, 4
    buf = buffer_process(group_size=G, batch_samples=2, max_groups=max_groups, max_batch_records=8)
    files = [producers.start(buf, f"p{i}", 200, G, window=64) for i in range(2)]
    learners = make_learners(buf.serve, delay=0.03)  # consumption ~10x slower than ingest
    peak_ready = peak_live = 0
    saw_backpressure = False
    try:
        with BatchClient(buf.serve) as probe:
            deadline = time.monotonic() + 240
            while len(learners.trained) < 400 and time.monotonic() < deadline:
                s = probe.status(timeout=10).scalars
                peak_ready = max(peak_ready, int(s["depth/ready_groups"]))
                peak_live = max(peak_live, int(s["depth/live_trajectories"]))
                saw_backpressure |= s["backpressure"] == 1.0
                time.sleep(0.05)
        producers.wait(timeout=60)
    finally:
        learners.stop()
    assert saw_backpressure
    assert peak_ready <= max_groups
    assert peak_live <= max_groups * G + 2 * G + 2 * G  # ready + assembling + served shares
    assert_exactly_once(read_ids(*files), learners.trained)


@pytest.mark.timeout(300)
def test_malformed_messages_are_rejected_and_others_still_served(buffer_process, producers, make_learners):
    G = 2
    buf = buffer_process(group_size=G, batch_samples=4)
    bad = producers.start(buf, "broken", 40, G, malformed_every=5)
    good = producers.start(buf, "fine", 40, G)
    # a peer sending something that is not Tidal at all
    with push(buf.ingest) as rogue:
        rogue.socket.send_multipart([b"GET / HTTP/1.1\r\n\r\n"])
    learners = make_learners(buf.serve)
    try:
        producers.wait(timeout=240)
        learners.wait_for(80, timeout=60)
        with BatchClient(buf.serve) as probe:
            errors = probe.status(timeout=10).scalars["errors/protocol"]
    finally:
        learners.stop()
    assert errors >= 9  # 8 from the broken producer, 1 rogue
    assert_exactly_once(read_ids(bad, good), learners.trained)
    text = buf.log_text()
    assert "rejected a malformed message" in text and "not a Tidal message" in text


@pytest.mark.timeout(300)
def test_corrupted_tail_is_reported_and_skipped_without_losing_earlier_records(buffer_process, producers, tmp_path, make_learners):
    G = 2
    buf = buffer_process(group_size=G, batch_samples=2, fsync="always")
    acked_file = producers.start(buf, "c", 20, G)
    producers.wait(timeout=120)
    buf.stop()
    seg = sorted((tmp_path / "wal").glob("wal-*.log"))[-1]
    with open(seg, "ab") as f:  # a torn write: header promising more than was written, then junk
        f.write(b"\x00\x10\x00\x00\xde\xad\xbe\xef" + b"partial")
    buf.start()
    with BatchClient(buf.serve) as probe:
        s = probe.status(timeout=10).scalars
    assert s["wal/corrupt_bytes_skipped"] == 15
    learners = make_learners(buf.serve)
    try:
        learners.wait_for(20, timeout=60)
    finally:
        learners.stop()
    assert_exactly_once(read_ids(acked_file), learners.trained)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["drop", "release"])
def test_incomplete_groups_wait_then_follow_the_timeout_policy(buffer_process, producers, policy, make_learners):
    G = 4
    buf = buffer_process(group_size=G, batch_samples=4, group_timeout_s=2.0, incomplete=policy)
    full = producers.start(buf, "full", 8, G)
    partial = producers.start(buf, "part", 3, G)  # one group of 3 out of 4: never completes
    producers.wait(timeout=120)
    learners = make_learners(buf.serve)
    try:
        learners.wait_for(8, timeout=30)
        time.sleep(0.5)
        assert sorted(learners.trained) == sorted(read_ids(full))  # only complete groups so far
        # past the timeout: dropped, or released: a group of 3 that is served as a step of its own (a step
        # is as many whole groups as a full one holds: a short group makes a short step, never a step that
        # waits for one more group than the controller granted)
        if policy == "drop":
            s = buf.wait_status(lambda s: s.get("drops/timeout") == 3, 30, "the incomplete group dropped")
        else:
            learners.wait_for(11, timeout=30)
            s = buf.wait_status(lambda s: s["total/consumed"] == 11, 30, "the incomplete group released and trained")
    finally:
        learners.stop()
    assert s["depth/assembling_groups"] == 0
    if policy == "release":
        assert "drops/timeout" not in s and sorted(learners.trained) == sorted(read_ids(full) + read_ids(partial))
    assert len(read_ids(partial)) == 3


@pytest.mark.timeout(300)
def test_compaction_keeps_the_log_bounded_and_state_intact(buffer_process, producers, tmp_path, make_learners):
    G = 2
    buf = buffer_process(group_size=G, batch_samples=2, compact_bytes=20_000)
    learners = make_learners(buf.serve)
    files = [producers.start(buf, f"z{i}", 300, G, tokens=128) for i in range(2)]
    try:
        producers.wait(timeout=240)
        learners.wait_for(500, timeout=120)
        learners.stop()  # whatever is not consumed yet stays live across the restart
        # a housekeeping tick compacts after the last consumes: the log shrinks to the live state
        s = buf.wait_status(lambda s: s["wal/bytes"] < 20_000 + 2_000 * (s["depth/live_trajectories"] + 10), 30,
                            "the log compacted")
        buf.stop()
        wal_bytes = sum(p.stat().st_size for p in (tmp_path / "wal").glob("wal-*"))
        live = s["depth/live_trajectories"]
        assert s["wal/appended_bytes"] > 300_000
        # what stays on disk is the live state plus less than one compaction interval
        assert wal_bytes < 20_000 + 2_000 * (live + 10), (wal_bytes, live)
        buf.start()
        rest = make_learners(buf.serve)
        rest.wait_for(600 - len(learners.trained), timeout=120)
        rest.stop()
    finally:
        learners.stop()
    assert_exactly_once(read_ids(*files), learners.trained + rest.trained)


@pytest.mark.timeout(300)
def test_steps_sized_in_tokens_and_unbounded_streaming(buffer_process, producers, make_learners):
    G = 2
    # every producer trajectory has 8 prompt tokens and 1..16 completion tokens: 9..24 per sample
    buf = buffer_process(group_size=G, batch_tokens=200, max_groups=0)
    files = [producers.start(buf, f"t{i}", 100, G, tokens=16) for i in range(2)]
    producers.wait(timeout=240)  # unbounded: everything is taken in without a consumer
    with BatchClient(buf.serve) as probe:
        s = probe.status(timeout=10).scalars
    assert s["depth/ready_samples"] == 200 and s["backpressure"] == 0.0
    learners = make_learners(buf.serve, world_size=2, group_size=G)
    try:
        learners.wait_for(150, timeout=60)  # the tail that cannot fill a 200-token step may wait
    finally:
        learners.stop()
    steps: dict[str, int] = {}
    for _, batch_id, tokens in learners.batches:
        step = batch_id.split("-")[0]
        steps[step] = steps.get(step, 0) + tokens
    assert steps and all(200 <= t < 200 + 2 * 48 for t in steps.values())  # filled by whole groups
    acked = read_ids(*files)
    assert not [i for i, c in Counter(learners.trained).items() if c > 1] and set(learners.trained) <= set(acked)


@pytest.mark.timeout(300)
def test_a_rank_holds_several_batches_until_its_checkpoint_and_gets_them_again_after_a_restart(buffer_process, producers):
    """A learner acknowledges at its checkpoints: it asks for batch after batch while holding the earlier
    ones; a learner that restarts (a new client) is served the oldest unacknowledged batch again, under
    the same id and with the same samples, also across a kill -9 of the buffer."""
    buf = buffer_process(group_size=2, batch_samples=2, fsync="batch")
    acked_file = producers.start(buf, "w", 12, 2)
    producers.wait(timeout=120)
    assert len(read_ids(acked_file)) == 12

    def ids(batch) -> list[str]:
        return sorted(t.id for t in batch.trajectories)

    with BatchClient(buf.serve, retry_every=0.5) as first:
        held = [first.next_batch(0, timeout=30) for _ in range(3)]  # no acks in between
    assert len({b.batch_id for b in held}) == 3
    assert len({i for b in held for i in ids(b)}) == 6  # three different batches

    with BatchClient(buf.serve, retry_every=0.5) as restarted:  # the learner restarted from a checkpoint
        again = [restarted.next_batch(0, timeout=30) for _ in range(2)]
        assert [b.batch_id for b in again] == [b.batch_id for b in held[:2]]
        assert [ids(b) for b in again] == [ids(b) for b in held[:2]]
        restarted.ack([b.batch_id for b in again])  # its next checkpoint holds these two

    buf.kill9()
    buf.start()
    with BatchClient(buf.serve, retry_every=0.5) as after_crash:
        third = after_crash.next_batch(0, timeout=30)
        assert third.batch_id == held[2].batch_id and ids(third) == ids(held[2])
        rest = [after_crash.next_batch(0, timeout=30) for _ in range(3)]
        after_crash.ack([third.batch_id, *(b.batch_id for b in rest)])
        status = after_crash.status().scalars
    trained = [i for b in (*again, third, *rest) for i in ids(b)]
    assert sorted(trained) == sorted(read_ids(acked_file))  # all twelve, once each
    assert status["depth/outstanding_batches"] == 0.0 and status["total/consumed"] >= 8
