"""The buffer's group commit: what an ingest turn decided waits here until its WAL records are durable.

Every outward effect of a record (a trajectory or group acknowledged, a message refused, a formed share
sent to its learner) goes through three states:

    pending   its record is appended to the WAL and the effect is queued in `GroupCommit.pending`;
    logged    `commit` handed the records to the disk: fsynced in line, or (fsync "batch") flushed to
              the OS with an fsync requested from the WAL's `Syncer` thread, whose token it waits for;
    released  the fsync is done: `commit` or `release` returns the effects, in commit order, and the
              service sends them. An acknowledgement is a promise that the record survives a crash.

A commit runs once `max_records` records wait, once the oldest has waited `interval_s`, or when asked
for sooner (`within`: a learner waits for a share). Nothing here touches a socket. A crash before
release promised nothing: producers resend what was not acknowledged, the store acknowledges a resend
of a record it holds without a second copy, and a torn last record is skipped by replay.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tidal.buffer.wal import Syncer, WriteAheadLog
from tidal.core.protocol import ACK_GROUP, ACK_TRAJECTORY, Ack


def _by_source() -> defaultdict[str, list[str]]:
    return defaultdict(list)


@dataclass(slots=True)
class Effects:
    """What one commit lets out once its records are durable (in this order)."""

    formed: list[str] = field(default_factory=list)  # shares formed: sendable once released
    acks: defaultdict[str, list[str]] = field(default_factory=_by_source)  # source -> trajectory ids
    group_acks: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)  # source -> (group ids, refused member id -> why)
    refusals: list[tuple[str, str, str, str, str]] = field(default_factory=list)  # (source, ack kind, id, why, reason)
    replies: list[tuple[bytes, Any]] = field(default_factory=list)  # (learner peer, Batch) of not yet durable shares

    def acks_out(self) -> Iterator[tuple[str, Ack]]:
        """(source, Ack) to publish: trajectory acks, group acks (refused members named), refusals."""
        for source, ids in self.acks.items():
            yield source, Ack(kind=ACK_TRAJECTORY, ids=ids)
        for source, (gids, refused) in self.group_acks.items():
            yield source, Ack(kind=ACK_GROUP, ids=gids, refused=refused)
        for source, kind, item, why, reason in self.refusals:
            yield source, Ack(kind=kind, ids=[item], ok=False, detail=why, reason=reason)

    @property
    def rejected(self) -> int:
        """Trajectories and groups refused: whole messages, and group members one by one."""
        return len(self.refusals) + sum(len(refused) for _, refused in self.group_acks.values())


class GroupCommit:
    """One fsync per drained batch of WAL records; the effects of those records leave only after it.

    `syncer` is the WAL's fsync thread (fsync "batch") or None (fsync in line: "always", "never")."""

    def __init__(self, log: WriteAheadLog, max_records: int, interval_s: float, syncer: Syncer | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.max_records = max_records
        self.interval_s = interval_s
        self.syncer = syncer
        self.clock = clock
        self.pending = Effects()  # queued for the next commit
        self.due: float | None = None  # when the next commit must run (None: nothing waits)
        self._records = 0  # records appended since the last commit
        self._undurable: set[str] = set()  # shares whose Serve record is not durable yet: not sent
        self._logged: deque[tuple[int, Effects]] = deque()  # (syncer token, effects) in commit order

    # ------------------------------------------------------------------ pending

    def appended(self, n: int) -> None:
        """`n` records went into the WAL: commit them within `interval_s`."""
        if n:
            self._records += n
            self.within(self.interval_s)

    def within(self, delay: float) -> None:
        """Make sure a commit happens within `delay` seconds (records or effects are waiting for one)."""
        due = self.clock() + delay
        if self.due is None or due < self.due:
            self.due = due

    def ack(self, source: str, traj_id: str) -> None:
        self.pending.acks[source].append(traj_id)

    def ack_group(self, source: str, group_id: str, refused: dict[str, str]) -> None:
        gids, members = self.pending.group_acks.setdefault(source, ([], {}))
        gids.append(group_id)
        members.update(refused)

    def refuse(self, source: str, kind: str, item: str, why: str, reason: str = "refused") -> None:
        """A negative Ack for `item` (not resent by the producer), sent after the commit with the others."""
        self.pending.refusals.append((source, kind, item, why, reason))

    def formed(self, batch_id: str) -> None:
        """A share's Serve record was appended: it is not sent before that record is durable."""
        self._undurable.add(batch_id)
        self.pending.formed.append(batch_id)

    def reply(self, peer: bytes, batch: Any) -> None:
        """Send `batch` (a share not yet durable) to `peer` as soon as its commit is done: a learner waits."""
        self.pending.replies.append((peer, batch))
        self.within(0.0)

    def durable(self, batch_id: str) -> bool:
        return batch_id not in self._undurable

    # ------------------------------------------------------------------ logged, released

    @property
    def logged(self) -> int:
        """Commits whose fsync runs on the syncer thread, their effects held until it is done."""
        return len(self._logged)

    def timeout(self, idle: float = 0.1) -> float:
        """How long the service may wait for sockets before the next commit is due."""
        return idle if self.due is None else max(0.0, self.due - self.clock())

    def commit(self, force: bool = False) -> list[Effects]:
        """Commit what is pending if it is due (or `force`). Returns the effects that are durable now,
        oldest first: with a syncer, none of this commit's until `release` (unless forced)."""
        if self.due is None:
            return []
        if not force and self._records < self.max_records and self.clock() < self.due:
            return []
        effects, self.pending = self.pending, Effects()
        self._records = 0
        self.due = None
        if self.syncer is not None and not force:
            self.log.flush()
            self._logged.append((self.syncer.request(), effects))
            return []
        out = self.drain() if self.syncer is not None else []
        self.log.sync()
        self._check()
        return [*out, self._released(effects)]

    def release(self) -> list[Effects]:
        """The effects of every commit whose fsync has finished, in commit order."""
        if self.syncer is None:
            return []
        self.syncer.clear_wakeups()
        done = self.syncer.done
        if self._logged and self._logged[0][0] <= done:
            self._check()
        out = []
        while self._logged and self._logged[0][0] <= done:
            out.append(self._released(self._logged.popleft()[1]))
        return out

    def drain(self) -> list[Effects]:
        """Wait for every fsync in flight; their effects (before the sockets close)."""
        if self.syncer is None:
            return []
        self.syncer.wait()
        return self.release()

    def close(self) -> list[Effects]:
        """`drain`, then stop the syncer thread."""
        out = self.drain()
        if self.syncer is not None:
            self.syncer.close()
            self.syncer = None
        return out

    def _released(self, effects: Effects) -> Effects:
        self._undurable.difference_update(effects.formed)
        return effects

    def _check(self) -> None:
        if self.syncer is not None and self.syncer.error is not None:
            raise OSError(f"fsync of the write-ahead log in {self.log.dir} failed: {self.syncer.error}; "
                          "nothing more is acknowledged (the unacknowledged data is resent by its producers)")
