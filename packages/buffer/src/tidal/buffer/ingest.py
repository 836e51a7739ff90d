"""The buffer service's ingest: trajectories and trajectory groups in from the PULL socket, checked,
admitted (WAL first) and acknowledged after the commit.

A `TrajectoryGroup` is admitted as one WAL record (`PutMessage`, the message as it came, when every member
is admitted unchanged; else `PutGroup` of the admitted members) and acknowledged as one
(``Ack(kind=ACK_GROUP, ids=[group id])``). Its members meet the rules a lone trajectory meets, member by
member: known ids are acknowledged again without a second copy, the admission policy refuses stale
members one by one (named in ``Ack.refused``; the others are kept), so a group and the same trajectories
sent singly end in the same state. A group that is malformed as a whole — no members, a member of
another group, an id twice, or a member that fails `validate` — is refused whole (``ok=False``, the reason
naming the member): it comes from a broken producer, and half of it would skew the group's advantages.

Nothing is copied on the way through: a one-frame message is read as `Sample`s whose arrays are views
into the received frame (`validate` checks their byte counts), the WAL writes that frame, the store keeps
members' encodings as views into it, and a Batch splices them in as they are.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from tidal.buffer import wal
from tidal.buffer.store import (
    GROUP_TYPES,
    PREAMBLE,
    VIEW_AT_LEAST,
    Group,
    body_of,
    decode_body,
    decode_samples,
    encode_trajectory,
    masked,
    member_bodies,
    sample_of,
)
from tidal.buffer.validate import Refusal, check_all_values, validate, validate_group
from tidal.core.codec import MAGIC, PREAMBLE_BYTES
from tidal.core.errors import ChannelTimeout, ProtocolError
from tidal.core.protocol import PROTOCOL_VERSION, TrajectoryGroup

if TYPE_CHECKING:
    from tidal.buffer.commit import GroupCommit
    from tidal.buffer.config import BufferConfig
    from tidal.buffer.store import Store
    from tidal.core.channels import PullChannel

log = logging.getLogger("tidal.buffer")
INGEST_CHUNK = 64  # trajectories taken per turn of the loop: learner requests wait at most this long
# An ingested message at least this large is kept as a view of the received ZeroMQ message (the WAL writes
# it and the store keeps members' encodings from it) instead of being copied out first. Smaller messages
# are copied: libzmq may receive them into a shared 8 KiB batch, which a view would keep alive whole.
INGEST_VIEW_BYTES = VIEW_AT_LEAST
_GROUPS = (*GROUP_TYPES, TrajectoryGroup)
# protocol errors logged one by one; after these, every 1000th (all are counted: errors/protocol/<reason>)
LOGGED_ERRORS = 100


REMEMBER_REFUSED = 65_536  # ids of refused trajectories kept to refuse a resend without counting it again


class Ingest:
    """What the buffer service takes in; `BufferService` is the one class built on it."""

    if TYPE_CHECKING:  # the service's, which this part uses
        cfg: BufferConfig
        wal: wal.WriteAheadLog
        store: Store
        admission: Any
        filters: list[tuple[str, Any]]
        ingest: PullChannel
        commits: GroupCommit
        learner_version: int
        _learner_known: bool
        _max_frame: int
        _ingested_since: int
        protocol_errors: int
        refused_by: dict[str, int]
        admission_refused: dict[str, str]

        def backpressured(self) -> bool: ...
        def maybe_compact(self) -> None: ...
        def _protocol_error(self, e: ProtocolError) -> None: ...

    def drain_ingest(self) -> None:
        n = 0
        taken = 0  # messages taken this turn, bad ones too: a flood of garbage cannot keep learners waiting
        while n < INGEST_CHUNK and taken < INGEST_CHUNK and not self.backpressured():
            try:
                frames = self.ingest.recv_frames(timeout=0, view_at_least=INGEST_VIEW_BYTES)
            except ChannelTimeout:
                break
            taken += 1
            try:
                msg, frame = self._decode(frames)
            except ProtocolError as e:  # of any kind: the codec turns every decode failure into this
                self._protocol_error(e)
                if self.protocol_errors <= LOGGED_ERRORS or self.protocol_errors % 1000 == 0:
                    log.warning("rejected a malformed message on %s (%d so far): %s", self.ingest.endpoint,
                                self.protocol_errors, e)
                continue
            if type(msg) in _GROUPS:
                n += len(msg.trajectories)
                verdict, refused = self.accept_group(msg, frame)
                if verdict is None:
                    self.commits.ack_group(msg.source, msg.id, refused)
                else:
                    self._refuse(msg.source, "group", msg.id, verdict)
                continue
            n += 1
            verdict = self.accept(msg, frame)
            if verdict is None:
                self.commits.ack(msg.source, msg.id)
            else:
                self._refuse(msg.source, "trajectory", msg.id, verdict)
        self.commits.appended(n)
        self._ingested_since += n
        self.maybe_compact()

    def _refuse(self, source: str, kind: str, item: str, verdict: str) -> None:
        """Tell `source` (a negative Ack, after the commit) that `item` is refused and why; counted by reason.
        The producer does not resend it (AckedPusher.rejected)."""
        reason = verdict.reason if isinstance(verdict, Refusal) else "refused"
        self.refused_by[reason] = self.refused_by.get(reason, 0) + 1
        self.commits.refuse(source, kind, item, str(verdict), reason)  # a plain str: msgspec encodes no subclass

    def _max_version(self) -> int | None:
        """The newest token version a trajectory may carry (None: unchecked)."""
        if self.cfg.version_slack < 0 or not self._learner_known:
            return None
        return self.learner_version + self.cfg.version_slack

    def _check_values(self, members: Any) -> tuple[int, Refusal] | None:
        """The first of `members` whose values cannot be trained on (its index, and why), or None."""
        cfg = self.cfg
        bad = check_all_values(members, cfg.vocab_size, self._max_version(), cfg.max_abs_reward)
        if bad is None:
            return None
        i, reason, detail = bad
        return i, Refusal(f"invalid trajectory {members[i].id}: {detail}", reason)

    def _decode(self, frames: list[Any]) -> tuple[Any, bytes | memoryview | None]:
        """The message and, when it came as one frame (every array inline, already the WAL's encoding),
        that frame. One frame decodes as Samples: arrays stay views into it, nothing is copied. Anything
        else, or anything the Sample decoder refuses, goes through the full codec, which names what is
        wrong (ProtocolError) or yields a Trajectory / TrajectoryGroup with out-of-line arrays."""
        if len(frames) == 1:
            f = frames[0]
            if PREAMBLE_BYTES < len(f) <= self._max_frame and f[:2] == MAGIC and f[2] == PROTOCOL_VERSION[0]:
                try:
                    return decode_samples(body_of(f)), f
                except Exception:  # any kind (a nested body's RecursionError too): the codec names it
                    pass
        return self.ingest.codec.decode(frames), None

    def accept(self, t: Any, frame: bytes | memoryview | None = None) -> str | None:
        """Admit `t`, a Sample decoded from `frame` or a Trajectory (WAL first). None when accepted or
        already known; else why it is refused."""
        if self.store.known(t.id):
            self.store.stats["duplicates"] += 1
            return None  # durable already: acknowledge again
        why = validate(t)
        if why is not None:
            return Refusal(f"invalid trajectory {t.id}: {why}", "invalid")
        bad = self._check_values((t,))
        if bad is not None:
            return bad[1]
        if self.admission is not None:
            why, mask = self._admit(t)
            if why is not None:
                return Refusal(why, "admission")
            if mask is not None:
                t, frame = masked(t, None if frame is None else body_of(frame), mask), None  # encode again
        if frame is None:
            frame = encode_trajectory(t)
            t = sample_of(body_of(frame))
        self.wal.append_put(frame)
        group = self.store.put(t, body_of(frame))
        if group is not None:
            self.on_group_complete(group)
        return None

    def _admit(self, t: Any) -> tuple[str | None, Any]:
        """The admission policy's verdict on `t`: why it is refused (or None), and the token mask it keeps
        (None: all of it; else the stored encoding is made again with the narrowed loss mask)."""
        assert self.admission is not None and self.cfg.admission is not None  # called only with a policy
        if (known := self.admission_refused.get(t.id)) is not None:  # a resend: refused again, counted once
            return known, None
        adm = self.admission.admit(t.versions.numpy(), self.learner_version)
        if not adm.admit:
            self.store.drops[f"admission:{adm.reason}"] = self.store.drops.get(f"admission:{adm.reason}", 0) + 1
            why = f"refused by {self.cfg.admission.name}: {adm.reason} (learner at version {self.learner_version})"
            self.admission_refused[t.id] = why
            if len(self.admission_refused) > REMEMBER_REFUSED:  # the oldest first (dicts keep insertion order)
                del self.admission_refused[next(iter(self.admission_refused))]
            return why, None
        return None, adm.token_mask

    def accept_group(self, g: Any, frame: bytes | memoryview | None = None) -> tuple[str | None, dict[str, str]]:
        """Admit the members of `g` (a SampleGroup decoded from `frame`, or a TrajectoryGroup) in one WAL
        record. Returns why the whole group is refused (or None), and the members refused one by one
        (id -> why); known members are acknowledged again."""
        why = validate_group(g)
        if why is not None:
            return Refusal(f"invalid group {g.id}: {why}", "invalid"), {}
        bad = self._check_values(g.trajectories)  # one bad member refuses the group whole (as validate_group)
        if bad is not None:
            i, why = bad
            return Refusal(f"invalid group {g.id}: trajectories[{i}]: {why}", why.reason), {}
        store = self.store
        # each member's encoding is a slice of the header when every array rode inline in it
        bodies = member_bodies(body_of(frame)) if frame is not None else None
        admitted: list[Any] = []
        kept: list[Any] = []
        refused: dict[str, str] = {}
        for i, t in enumerate(g.trajectories):
            if store.known(t.id):
                store.stats["duplicates"] += 1
                continue
            body: bytes | memoryview | msgspec.Raw | None = None if bodies is None else bodies[i]
            if self.admission is not None:
                why, mask = self._admit(t)
                if why is not None:
                    refused[t.id] = why
                    continue
                if mask is not None:
                    t, body = masked(t, body, mask), None
            if body is None:  # encoded again, every array inline, and held as a Sample of that
                body = body_of(encode_trajectory(t))
                t = sample_of(body)
            admitted.append(t)
            kept.append(body)
        if admitted:
            if (frame is not None and bodies is not None and len(admitted) == len(bodies)
                    and all(a is b for a, b in zip(kept, bodies, strict=True))):
                self.wal.append_message(frame)  # the whole group as it came: one piece, not one per member
            else:
                self.wal.append_group(kept, PREAMBLE)
            group = store.put_group(admitted, kept)
            if group is not None:
                self.on_group_complete(group)
        return None, refused

    def on_group_complete(self, group: Group) -> None:
        if not self.filters:
            return
        frames = self.store.frames  # filters see real Trajectories (the store holds Samples)
        rewards_group = [decode_body(frames[tid]) for tid in group.members]
        for name, keep in self.filters:
            if not keep(rewards_group):
                ids = list(group.members)
                self.wal.append(wal.Drop(ids, f"filter:{name}"))
                self.store.drop(ids, f"filter:{name}")
                return
