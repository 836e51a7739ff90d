"""The group commit without sockets: effects are pending until their records are committed, logged while
the fsync runs, and released (acknowledged, sent) only after it; a crash before release promised nothing."""

from __future__ import annotations

import pytest

from tidal.buffer import wal
from tidal.buffer.commit import GroupCommit
from tidal.buffer.store import PREAMBLE, Store, body_of, encode_trajectory
from tidal.core.protocol import ACK_GROUP, ACK_TRAJECTORY
from tidal.core.testing import make_trajectory


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeLog:
    dir = "/wal"

    def __init__(self) -> None:
        self.synced = self.flushed = 0

    def sync(self) -> None:
        self.synced += 1

    def flush(self) -> None:
        self.flushed += 1


class FakeSyncer:
    """`wal.Syncer` whose fsyncs finish when the test says so."""

    def __init__(self) -> None:
        self.requested = self.done = 0
        self.error: OSError | None = None

    def request(self) -> int:
        self.requested += 1
        return self.requested

    def finish(self, upto: int | None = None) -> None:
        self.done = self.requested if upto is None else upto

    def wait(self) -> None:
        self.finish()

    def clear_wakeups(self) -> None:
        pass

    def close(self) -> None:
        pass


def make(syncer=None, max_records: int = 4, interval: float = 0.005):
    clock, log = Clock(), FakeLog()
    return GroupCommit(log, max_records, interval, syncer, clock=clock), clock, log


def acked(released) -> list[tuple[str, str, list[str]]]:
    return [(src, ack.kind, ack.ids) for e in released for src, ack in e.acks_out()]


def test_nothing_is_committed_or_released_before_a_record_is_appended():
    gc, _, log = make()
    gc.ack("w", "t0")  # an effect alone does not start a commit: its record makes it due
    assert gc.due is None and gc.timeout() == 0.1
    assert gc.commit() == [] and log.synced == 0


def test_an_ack_waits_for_the_interval_then_leaves_after_one_fsync():
    gc, clock, log = make(interval=0.005)
    gc.appended(1)
    gc.ack("w", "t0")
    assert gc.due == pytest.approx(100.005) and gc.timeout() == pytest.approx(0.005)
    assert gc.commit() == [] and log.synced == 0  # pending: not due yet
    clock.now += 0.005
    released = gc.commit()
    assert log.synced == 1
    assert acked(released) == [("w", ACK_TRAJECTORY, ["t0"])]
    assert gc.due is None and acked(gc.commit(force=True)) == []  # nothing pending any more


def test_max_records_commits_at_once_and_one_fsync_covers_them_all():
    gc, _, log = make(max_records=4)
    for i in range(4):
        gc.appended(1)
        gc.ack("w", f"t{i}")
    released = gc.commit()
    assert log.synced == 1
    assert acked(released) == [("w", ACK_TRAJECTORY, ["t0", "t1", "t2", "t3"])]


def test_group_acks_gather_per_source_with_their_refused_members_and_count_as_rejected():
    gc, _, _ = make()
    gc.appended(8)
    gc.ack_group("w", "g0", {})
    gc.ack_group("w", "g1", {"g1-3": "stale"})
    gc.refuse("v", "trajectory", "t9", "invalid")
    (effects,) = gc.commit(force=True)
    out = list(effects.acks_out())
    assert [(s, a.kind, a.ids, a.refused) for s, a in out[:1]] == [("w", ACK_GROUP, ["g0", "g1"], {"g1-3": "stale"})]
    assert out[1][0] == "v" and out[1][1].ok is False and out[1][1].detail == "invalid"
    assert effects.rejected == 2  # one member of g1, and t9


def test_with_a_syncer_effects_are_logged_until_the_fsync_is_done_then_released_in_order():
    syncer = FakeSyncer()
    gc, clock, log = make(syncer)
    gc.appended(1)
    gc.ack("w", "t0")
    clock.now += 1
    assert gc.commit() == []  # logged: flushed, fsync requested, ack held
    assert (log.flushed, log.synced, syncer.requested, gc.logged) == (1, 0, 1, 1)
    gc.appended(1)
    gc.ack("w", "t1")
    clock.now += 1
    gc.commit()
    assert gc.logged == 2 and gc.release() == []  # no fsync has finished
    syncer.finish(upto=1)
    assert acked(gc.release()) == [("w", ACK_TRAJECTORY, ["t0"])] and gc.logged == 1
    syncer.finish()
    assert acked(gc.release()) == [("w", ACK_TRAJECTORY, ["t1"])] and gc.logged == 0


def test_a_formed_share_is_not_durable_and_its_reply_waits_until_its_commit_is_released():
    syncer = FakeSyncer()
    gc, _, _ = make(syncer, interval=10.0)
    gc.appended(1)
    gc.formed("b0-r0")
    gc.reply(b"peer", "batch")  # a learner waits: the commit is due now, not in 10 s
    assert not gc.durable("b0-r0") and gc.timeout() == 0.0
    gc.commit()
    assert not gc.durable("b0-r0")  # logged, not released
    syncer.finish()
    (effects,) = gc.release()
    assert effects.replies == [(b"peer", "batch")] and gc.durable("b0-r0")


def test_a_forced_commit_waits_for_fsyncs_in_flight_and_releases_them_first():
    syncer = FakeSyncer()
    gc, clock, log = make(syncer)
    gc.appended(1)
    gc.ack("w", "t0")
    clock.now += 1
    gc.commit()
    gc.appended(1)
    gc.ack("w", "t1")
    released = gc.commit(force=True)  # shutting down: everything durable now, oldest first
    assert acked(released) == [("w", ACK_TRAJECTORY, ["t0"]), ("w", ACK_TRAJECTORY, ["t1"])]
    assert log.synced == 1 and gc.logged == 0


def test_a_failed_fsync_releases_nothing_and_says_so():
    syncer = FakeSyncer()
    gc, clock, _ = make(syncer)
    gc.appended(1)
    gc.ack("w", "t0")
    clock.now += 1
    gc.commit()
    syncer.error = OSError("EIO")
    syncer.finish()
    with pytest.raises(OSError, match="fsync of the write-ahead log in /wal failed: EIO"):
        gc.release()


def test_a_resend_is_acknowledged_again_but_never_before_the_original_is_durable():
    store, syncer = Store(group_size=4), FakeSyncer()
    gc, clock, _ = make(syncer)
    t = make_trajectory(0)
    t.group_id = "g0"
    store.put(t)
    gc.appended(1)
    gc.ack("w", t.id)
    clock.now += 1
    gc.commit()  # the original's fsync is in flight
    assert store.known(t.id)  # the resend: the service does not store it again, it acks it again
    gc.appended(1)
    gc.ack("w", t.id)
    clock.now += 1
    gc.commit()
    syncer.finish(upto=1)
    assert acked(gc.release()) == [("w", ACK_TRAJECTORY, [t.id])]  # the original's commit only
    syncer.finish()
    assert acked(gc.release()) == [("w", ACK_TRAJECTORY, [t.id])]
    assert store.live_trajectories == 1 and store.stats["accepted"] == 1


def _member(i: int, group: str = "g0"):
    t = make_trajectory(i)
    t.group_id = group
    return t


def test_a_group_torn_in_its_commit_is_gone_after_replay_unacknowledged_and_taken_whole_when_resent(tmp_path):
    log = wal.WriteAheadLog(tmp_path, fsync="batch")
    log.replay()
    syncer = wal.Syncer(log)
    gc = GroupCommit(log, 512, 0.005, syncer)
    members = [_member(i) for i in range(4)]
    log.append_group([body_of(encode_trajectory(t)) for t in members], PREAMBLE)
    gc.appended(1)
    gc.ack_group("w", "g0", {})
    gc.within(0.0)
    gc.commit()  # written to the OS and logged; the process dies before the fsync is released
    assert gc.logged == 1
    seg = log.segments()[-1]
    syncer.close()
    size = seg.stat().st_size
    with open(seg, "r+b") as f:  # the power loss tore the group's record
        f.truncate(size // 2)

    records, report = wal.WriteAheadLog(tmp_path).replay()
    assert records == [] and report.corrupt_bytes == size // 2  # no member half-applied
    store = Store(group_size=4)
    assert not any(store.known(t.id) for t in members)  # the resent group is new: stored whole
    assert store.put_group(members, [body_of(encode_trajectory(t)) for t in members]) is not None
    assert list(store.ready) == ["g0"]


def test_a_group_of_lone_trajectories_half_logged_before_a_crash_completes_with_the_resends(tmp_path):
    log = wal.WriteAheadLog(tmp_path)
    log.replay()
    members = [_member(i) for i in range(4)]
    for t in members[:2]:  # durable (and acknowledged) before the crash
        log.append_put(encode_trajectory(t))
    log.sync()
    log.append_put(encode_trajectory(members[2]))  # appended, never synced nor acknowledged: lost

    records, _ = wal.WriteAheadLog(tmp_path).replay()
    store = Store(group_size=4)
    for rec in records:
        store.apply(rec)
    assert list(store.assembling) == ["g0"] and len(store.assembling["g0"].members) == 2
    # every producer resends what it holds unacknowledged (and the acked ones may come again too)
    completed = [store.put(t) for t in members if not store.known(t.id)]
    assert completed[-1] is not None and list(store.ready) == ["g0"]
    assert sorted(store.ready["g0"].members) == sorted(t.id for t in members)
