"""The buffer's state as a deterministic state machine over WAL records.

The live service and replay after a crash go through the same transitions: every decision that
changes what will be trained on (a trajectory accepted, a group dropped or released, a batch served or
consumed) is a record, applied here and appended to the log by the service. Nothing here does I/O.
"""

from __future__ import annotations

import itertools
import time
import typing
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from tidal.buffer import wal
from tidal.core.arrays import Array, DType, Shape
from tidal.core.codec import MAGIC, PREAMBLE_BYTES, Codec
from tidal.core.protocol import NO_VERSION, PROTOCOL_VERSION, Trajectory, TrajectoryGroup

# One codec with every array inline: a WAL record is a single self-contained frame.
# the buffer's own encodings (WAL records, stored members): what ingest admitted, within its limits already
_codec = Codec(inline_threshold=1 << 62, max_message_bytes=1 << 40, max_header_bytes=1 << 40)
PREAMBLE = MAGIC + bytes(PROTOCOL_VERSION)  # what starts a frame this process encodes


def encode_trajectory(t: Trajectory) -> bytes:
    return bytes(_codec.encode(t)[0])


def body_of(frame: bytes | memoryview) -> memoryview:
    """The msgpack of the Trajectory in a frame (what is stored and served), without copying."""
    return memoryview(frame)[PREAMBLE_BYTES:]


def frame_of(body: bytes | memoryview) -> bytes:
    return PREAMBLE + body


def decode_trajectory(frame: bytes) -> Trajectory:
    msg = _codec.decode([frame])
    if type(msg) is not Trajectory:
        raise ValueError(f"WAL Put holds a {type(msg).__name__}, not a Trajectory")
    return msg


class ArrayView(msgspec.Struct, array_like=True, gc=False):
    """An `Array` as the buffer reads it off an inline frame: `data` is a view into the received message,
    not a copy (the byte count is checked by `validate`, not here: no Python call per array)."""

    dtype: DType  # as Array.dtype
    shape: Shape  # as Array.shape
    data: memoryview  # the inline bytes (an out-of-line reference does not decode: the full codec takes it)

    def numpy(self) -> Any:
        return _numpy(self)


class ArrayBytes(msgspec.Struct, array_like=True, gc=False):
    """`ArrayView` for a small message: its bytes copied (cheaper than a view object when they are few)."""

    dtype: DType  # as Array.dtype
    shape: Shape  # as Array.shape
    data: bytes  # the inline bytes

    def numpy(self) -> Any:
        return _numpy(self)


ARRAY_READS = (ArrayView, ArrayBytes)


def _numpy(a: Any) -> Any:
    return np.frombuffer(a.data, dtype=np.dtype(a.dtype).newbyteorder("<")).reshape(a.shape)


def _read_as(tp: Any, array: type) -> Any:
    """`tp` with Array replaced by `array` (also inside `Array | None`)."""
    if tp is Array:
        return array
    args = typing.get_args(tp)
    if Array in args:
        return typing.Union[tuple(array if a is Array else a for a in args)]  # noqa: UP007
    return tp


def _sample_type(name: str, array: type) -> Any:
    fields: list[tuple] = []
    for f in msgspec.structs.fields(Trajectory):
        tp = _read_as(f.type, array)
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, tp, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, tp, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, tp))
    sample = msgspec.defstruct(name, fields, tag="Trajectory", array_like=True, gc=False, module=__name__)
    group = msgspec.defstruct(f"{name}Group", [("id", str), ("trajectories", list[sample]),  # type: ignore[valid-type]  # made at run time by defstruct
                                               ("source", str, "")],
                              tag="TrajectoryGroup", array_like=True, gc=False, module=__name__)
    return sample, group


# A Trajectory as the buffer holds it: the same wire layout (tag, fields, order, defaults; made from
# Trajectory's own fields, so it cannot drift) with every array an ArrayView, a view into the received
# message. The buffer routes, logs and serves samples without copying their arrays, and serves them as
# the bytes they arrived in. Group filters and re-masking get a real `Trajectory` (`decode_body`). A
# small message is read as SmallSamples (arrays as ArrayBytes: for a few hundred bytes, a copy costs
# less than a view object).
Sample, SampleGroup = _sample_type("Sample", ArrayView)
SmallSample, SmallSampleGroup = _sample_type("SmallSample", ArrayBytes)
GROUP_TYPES = (SampleGroup, SmallSampleGroup)
assert [f.name for f in msgspec.structs.fields(TrajectoryGroup)] == [f.name for f in msgspec.structs.fields(SampleGroup)]
# a message at least this large is read as Samples (views), a smaller one copied: above libzmq's 8 KiB
# receive batch a message has a buffer of its own (a 16 KiB trajectory encodes to a little under 16 KiB)
VIEW_AT_LEAST = 12 * 1024
LAG_SAMPLE_GROUPS = 256  # groups looked at for the lag histogram (a strided sample of the ready ones)


class _RawGroup(msgspec.Struct, tag="TrajectoryGroup", array_like=True, gc=False):
    """A TrajectoryGroup header read for its members' encodings (views into the header, not copies)."""

    id: str
    trajectories: list[msgspec.Raw]


_raw_group = msgspec.msgpack.Decoder(_RawGroup)
_samples = msgspec.msgpack.Decoder(Sample | SampleGroup)
_small_samples = msgspec.msgpack.Decoder(SmallSample | SmallSampleGroup)
_sample = msgspec.msgpack.Decoder(Sample)
_small_sample = msgspec.msgpack.Decoder(SmallSample)


def decode_samples(body: memoryview) -> Any:
    """A Sample or SampleGroup (SmallSample... below VIEW_AT_LEAST bytes) from the msgpack body of an
    inline frame. Raises msgspec errors for anything else (the caller asks the full codec why)."""
    return (_samples if len(body) >= VIEW_AT_LEAST else _small_samples).decode(body)


def member_bodies(body: bytes | memoryview) -> list[msgspec.Raw]:
    """The encodings of a TrajectoryGroup's members, from the msgpack body of its one frame (`Raw`
    objects: buffers that refer into `body`, not copies; cheaper to make than memoryviews)."""
    return _raw_group.decode(body).trajectories


def sample_of(body: bytes | memoryview) -> Any:
    """The Sample a stored encoding holds (views into `body`; a SmallSample when it is small)."""
    return (_sample if len(body) >= VIEW_AT_LEAST else _small_sample).decode(body)


def decode_body(body: bytes | memoryview) -> Trajectory:
    """A real Trajectory (arrays copied out) from a stored encoding, for filters and re-masking."""
    return decode_trajectory(frame_of(body))


def masked(t: Any, body: bytes | memoryview | None, keep: Any) -> Trajectory:
    """A real Trajectory of `t` (a Sample, read again from its encoding `body`, or a Trajectory) with its
    loss mask narrowed to `keep`."""
    real = decode_body(body) if body is not None and type(t) is not Trajectory else t
    return msgspec.structs.replace(real, loss_mask=_and_mask(real.loss_mask, keep))


def _and_mask(existing: Any, keep: Any) -> Array:
    m = np.asarray(keep, dtype=np.uint8)
    if existing is not None:
        m = m & existing.numpy().astype(np.uint8)
    return Array.from_numpy(m)


assert [f.name for f in msgspec.structs.fields(TrajectoryGroup)] == [f.name for f in msgspec.structs.fields(SampleGroup)]


def num_tokens(t: Trajectory) -> int:
    return (t.prompt_ids.shape[0] if t.prompt_ids.shape else 0) + (
        t.completion_ids.shape[0] if t.completion_ids.shape else 0
    )


class RecentIds:
    """The ids seen most recently: between the last `window // 2` and the last `window` of them, in two
    generations of sets (adding is a set insert; the older generation is dropped whole)."""

    def __init__(self, window: int, ids: Iterable[str] = ()) -> None:
        self.half = max(1, window // 2)
        self.old: set[str] = set()
        self.new: set[str] = set()
        for i in ids:
            self.add(i)

    def add(self, i: str) -> None:
        new = self.new
        new.add(i)
        if len(new) >= self.half:
            self.old, self.new = new, set()

    def update(self, ids: Iterable[str]) -> None:
        """`add` of each of `ids` (the generation turns over after them, not in their midst)."""
        new = self.new
        new.update(ids)
        if len(new) >= self.half:
            self.old, self.new = new, set()

    def __contains__(self, i: object) -> bool:
        return i in self.new or i in self.old

    def __len__(self) -> int:
        return len(self.old) + len(self.new)

    def __iter__(self) -> Iterator[str]:
        yield from self.old
        yield from self.new


@dataclass
class Group:
    group_id: str
    size: int  # expected number of samples
    members: dict[str, Any] = field(default_factory=dict)  # trajectory id -> its Sample (or Trajectory)
    first_seen: float = field(default_factory=time.monotonic)
    tokens: int = 0  # prompt + completion tokens of the members (kept up to date by Store)


@dataclass
class Served:
    batch_id: str
    rank: int
    world_size: int
    trajectories: list[Any]  # Samples (or Trajectories), in order
    tokens: int = 0  # prompt + completion tokens of the trajectories
    formed_at: float = field(default_factory=time.time)  # wall clock (a replayed share: its replay)


class Store:
    def __init__(self, group_size: int, dedupe_window: int = 1_000_000) -> None:
        self.group_size = group_size
        self.dedupe_window = dedupe_window
        self.assembling: dict[str, Group] = {}  # incomplete groups
        self.ready: OrderedDict[str, Group] = OrderedDict()  # complete (or released) groups, FIFO
        self.outstanding: dict[str, Served] = {}  # served, not yet consumed
        self.pending_shares: dict[int, deque[str]] = {}  # rank -> its unconsumed shares, oldest first
        self.where: dict[str, str] = {}  # live trajectory id -> group id or batch id
        self.consumed_ids = RecentIds(dedupe_window)
        self.consumed_batches = RecentIds(200_000)
        self.next_batch_seq = 0
        # live trajectory id -> its msgpack encoding (no preamble), served raw: a view (memoryview or
        # msgspec.Raw) into the message it arrived in, so a group's members share its buffer
        self.frames: dict[str, bytes | memoryview | msgspec.Raw] = {}
        self.live_bytes = 0
        self.stats = {"accepted": 0, "consumed": 0, "served": 0, "dropped": 0, "duplicates": 0}
        self.drops: dict[str, int] = {}

    # ------------------------------------------------------------------ queries

    def known(self, traj_id: str) -> bool:
        return traj_id in self.where or traj_id in self.consumed_ids

    @property
    def ready_samples(self) -> int:
        return sum(len(g.members) for g in self.ready.values())

    @property
    def live_trajectories(self) -> int:
        return len(self.where)

    def lag_histogram(self, learner_version: int) -> np.ndarray:
        """Lag (learner version - oldest token version) of the ready samples, 16 bins (the last one is
        15+). Over a strided sample of at most LAG_SAMPLE_GROUPS groups, counts scaled to the whole: a
        deep unbounded buffer would otherwise spend a fifth of its time here."""
        groups = self.ready
        stride = max(1, -(-len(groups) // LAG_SAMPLE_GROUPS))
        lags = [_oldest_lag(t.versions.numpy(), learner_version)
                for g in itertools.islice(groups.values(), 0, None, stride) for t in g.members.values()]
        hist = np.bincount(np.clip(np.asarray(lags, np.int64), 0, 15), minlength=16) * stride
        return hist.astype(np.int64)

    # ------------------------------------------------------------------ transitions

    def put(self, t: Trajectory, body: bytes | memoryview | None = None) -> Group | None:
        """Add an accepted trajectory with its encoding (`body_of` its frame). Returns its group when this
        completed it."""
        tid, gid = t.id, t.group_id
        if tid in self.where or tid in self.consumed_ids:
            self.stats["duplicates"] += 1
            return None
        body = body_of(encode_trajectory(t)) if body is None else body
        self.frames[tid] = body
        self.live_bytes += len(body)
        self.where[tid] = gid
        self.stats["accepted"] += 1
        g = self.assembling.get(gid)
        assembling = g is not None
        if g is None:  # a late member of a group released early joins it where it is (ready)
            g = self.ready.get(gid)
            if g is None:
                g = self.assembling[gid] = Group(gid, t.group_size or self.group_size)
                assembling = True
        g.members[tid] = t
        g.tokens += num_tokens(t)
        if assembling and len(g.members) >= g.size:
            del self.assembling[gid]
            self.ready[gid] = g
            return g
        return None

    def put_group(self, trajs: list[Trajectory], bodies: list[bytes | memoryview]) -> Group | None:
        """`put` of members of one group that are not known (the caller checked), in one pass: the state
        is the same as after putting them one by one."""
        gid = trajs[0].group_id
        g = self.assembling.get(gid)
        assembling = g is not None
        if g is None:
            g = self.ready.get(gid)
            if g is None:
                g = self.assembling[gid] = Group(gid, trajs[0].group_size or self.group_size)
                assembling = True
        frames, where, members = self.frames, self.where, g.members
        size = tokens = 0
        for t, body in zip(trajs, bodies, strict=True):
            tid = t.id
            frames[tid] = body
            where[tid] = gid
            members[tid] = t
            size += len(body)
            tokens += t.prompt_ids.shape[0] + t.completion_ids.shape[0]  # 1-D: validated
        self.live_bytes += size
        g.tokens += tokens
        self.stats["accepted"] += len(trajs)
        if assembling and len(members) >= g.size:
            del self.assembling[gid]
            self.ready[gid] = g
            return g
        return None

    def release(self, group_id: str) -> None:
        g = self.assembling.pop(group_id, None)
        if g is not None:
            self.ready[group_id] = g

    def drop(self, ids: list[str], reason: str) -> None:
        for i in ids:
            gid = self.where.pop(i, None)
            if gid is None:
                continue
            # settled for good, like a consumed one: a resend (its ack was lost) must not bring it back,
            # or a filtered group is filtered (and counted) again, or half of it waits for a group timeout
            self.consumed_ids.add(i)
            self.live_bytes -= len(self.frames.pop(i, b""))
            for groups in (self.assembling, self.ready):
                g = groups.get(gid)
                if g is not None:
                    t = g.members.pop(i, None)
                    if t is not None:
                        g.tokens -= num_tokens(t)
                    if not g.members:
                        del groups[gid]
            self.stats["dropped"] += 1
            self.drops[reason] = self.drops.get(reason, 0) + 1

    def serve(self, batch_id: str, rank: int, world_size: int, ids: list[str]) -> Served:
        trajs = []
        where, ready = self.where, self.ready
        before: dict[str, int] = {}  # group id -> its token count before this share took members
        for i in ids:
            gid = where.get(i)
            g = ready.get(gid) if gid is not None else None
            if gid is None or g is None or i not in g.members:
                raise KeyError(f"trajectory {i} is not ready to serve")
            trajs.append(g.members.pop(i))
            if gid not in before:
                before[gid] = g.tokens
            where[i] = batch_id
        tokens = 0
        for gid, n in before.items():  # a group taken whole (the usual case) needs no count per member
            g = ready[gid]
            if g.members:
                g.tokens = sum(num_tokens(t) for t in g.members.values())
                tokens += n - g.tokens
            else:
                tokens += n
                del ready[gid]
        served = Served(batch_id, rank, world_size, trajs, tokens)
        self.outstanding[batch_id] = served
        self.pending_shares.setdefault(rank, deque()).append(batch_id)
        self.stats["served"] += len(trajs)
        seq = int(batch_id.split("-")[0][1:]) if batch_id.startswith("b") else -1
        self.next_batch_seq = max(self.next_batch_seq, seq + 1)
        return served

    def consume(self, batch_id: str) -> bool:
        """Mark a served batch trained. False when unknown (already consumed: idempotent)."""
        served = self.outstanding.pop(batch_id, None)
        if served is None:
            return False
        where, frames = self.where, self.frames
        ids = [t.id for t in served.trajectories]
        size = 0
        for i in ids:
            where.pop(i, None)
            size += len(frames.pop(i, b""))
        self.live_bytes -= size
        self.consumed_ids.update(ids)
        q = self.pending_shares.get(served.rank)
        if q is not None and batch_id in q:
            q.remove(batch_id)
        self.consumed_batches.add(batch_id)
        self.stats["consumed"] += len(served.trajectories)
        return True

    def apply(self, rec: wal.Record) -> None:
        """Replay one WAL record."""
        if type(rec) is wal.Put:
            body = body_of(rec.frame)
            self.put(sample_of(body), body)
        elif type(rec) is wal.PutGroup:
            for frame in rec.frames:
                body = body_of(frame)
                self.put(sample_of(body), body)
        elif type(rec) is wal.PutMessage:
            for raw in member_bodies(body_of(rec.frame)):
                self.put(sample_of(raw), raw)
        elif type(rec) is wal.Serve:
            self.serve(rec.batch_id, rec.rank, rec.world_size, rec.ids)
        elif type(rec) is wal.Consume:
            self.consume(rec.batch_id)
        elif type(rec) is wal.Drop:
            self.drop(rec.ids, rec.reason)
        elif type(rec) is wal.Release:
            self.release(rec.group_id)
        elif type(rec) is wal.Restore:
            self.restore(rec.batch_id, rec.rank, rec.world_size, [sample_of(body_of(f)) for f in rec.frames], rec.frames)
        elif type(rec) is wal.Snapshot:
            self.next_batch_seq = rec.next_batch_seq
            self.consumed_ids = RecentIds(self.dedupe_window, rec.consumed_ids)
            self.consumed_batches = RecentIds(200_000, rec.consumed_batches)

    def restore(self, batch_id: str, rank: int, world_size: int, trajs: list[Trajectory], frames: list[bytes]) -> None:
        for t, frame in zip(trajs, frames, strict=True):
            self.where[t.id] = batch_id
            self.frames[t.id] = body_of(frame)
            self.live_bytes += len(frame) - PREAMBLE_BYTES
        self.outstanding[batch_id] = Served(batch_id, rank, world_size, trajs, sum(num_tokens(t) for t in trajs))
        self.pending_shares.setdefault(rank, deque()).append(batch_id)

    def snapshot(self) -> Iterator[wal.Record]:
        """The live state as records (for compaction): replaying them rebuilds this store."""
        yield wal.Snapshot(self.next_batch_seq, list(self.consumed_ids), list(self.consumed_batches))
        for gid, g in self.ready.items():
            yield wal.PutGroup([frame_of(self.frames[tid]) for tid in g.members])
            if len(g.members) < g.size:  # released early or thinned by drops: still ready
                yield wal.Release(gid)
        for g in self.assembling.values():
            yield wal.PutGroup([frame_of(self.frames[tid]) for tid in g.members])
        for s in self.outstanding.values():
            yield wal.Restore(s.batch_id, s.rank, s.world_size, [frame_of(self.frames[t.id]) for t in s.trajectories])


def _oldest_lag(versions: np.ndarray, current: int) -> int:
    """Lag of a trajectory's oldest sampled token (tokens with NO_VERSION, not sampled, are skipped)."""
    v = versions[versions > NO_VERSION]
    return current - int(v.min()) if v.size else 0
