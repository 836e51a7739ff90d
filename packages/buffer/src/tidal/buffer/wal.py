"""The buffer's write-ahead log: append-only, length-prefixed, checksummed msgspec records.

Record on disk: ``u32 length | u32 checksum | payload`` (little-endian; the checksum is the low 32 bits
of the payload's XXH3-64, a few times cheaper than crc32 on these sizes); payload is a msgpack
tagged `Record`. The log is a sequence of segment files ``wal-<n>.log``; compaction writes a new
segment that starts with a `Snapshot` of the live state and deletes the older ones, so the log stays
bounded. Replay reads from the newest segment that starts with a snapshot.

A torn or corrupted record (a crash mid-write, a bad disk block) is detected by its length or checksum,
reported, and skipped: replay resynchronises on the next record whose checksum holds, and the file is
truncated after the last good record before new records are appended.
"""

from __future__ import annotations

import io
import logging
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from xxhash import xxh3_64, xxh3_64_intdigest

log = logging.getLogger(__name__)

HEADER = struct.Struct("<II")
MAX_RECORD = 1 << 30


def checksum(payload: bytes | memoryview) -> int:
    return xxh3_64_intdigest(payload) & 0xFFFFFFFF


class Put(msgspec.Struct, tag=True, array_like=True, gc=False):
    frame: bytes  # the Trajectory, encoded by tidal.core's codec with every array inline


class PutGroup(msgspec.Struct, tag=True, array_like=True, gc=False):
    frames: list[bytes]  # the admitted members of one TrajectoryGroup, each encoded like Put.frame


class PutMessage(msgspec.Struct, tag=True, array_like=True, gc=False):
    frame: bytes  # a TrajectoryGroup message as received (one frame, every array inline), every member admitted


class Serve(msgspec.Struct, tag=True, array_like=True, gc=False):
    batch_id: str  # id of the served share
    rank: int  # learner rank it was served to
    world_size: int  # data-parallel world size of the step
    ids: list[str]  # trajectory ids in the share, in order


class Consume(msgspec.Struct, tag=True, array_like=True, gc=False):
    batch_id: str  # acknowledged by the learner: its trajectories are trained on


class Drop(msgspec.Struct, tag=True, array_like=True, gc=False):
    ids: list[str]  # trajectory ids removed without training
    reason: str  # "filter:<name>", "timeout", "stale", ...


class Release(msgspec.Struct, tag=True, array_like=True, gc=False):
    group_id: str  # an incomplete group released to training as it is (timeout policy "release")


class Snapshot(msgspec.Struct, tag=True, array_like=True, gc=False):
    next_batch_seq: int  # next global batch number
    consumed_ids: list[str]  # recent consumed trajectory ids (dedupe window)
    consumed_batches: list[str]  # recent consumed batch ids (idempotent acks)


class Restore(msgspec.Struct, tag=True, array_like=True, gc=False):
    batch_id: str  # a served, unconsumed batch carried over by compaction
    rank: int  # learner rank it was served to
    world_size: int  # data-parallel world size of the step
    frames: list[bytes]  # its trajectories, encoded like Put.frame


Record = Put | PutGroup | PutMessage | Serve | Consume | Drop | Release | Snapshot | Restore

_encoder = msgspec.msgpack.Encoder()
_PENDING_LIMIT = 1 << 20  # appended bytes held before they are written to the file
_IOV_MAX = 1024  # pieces per writev (Linux's limit)
_JOIN_LIMIT = 8 * 1024  # a Put frame smaller than this is joined to its prefix (cheaper than a hash state)
_decoder = msgspec.msgpack.Decoder(Record)


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _put_prefix(n: int) -> bytes:
    """msgpack of ``Put(frame)`` up to the frame's bytes (a 2-array: tag, bin header), as msgspec
    writes it: `append` writes Put records without copying the frame (tested against msgspec)."""
    return b"\x92\xa3Put" + _bin_header(n)


def _message_prefix(n: int) -> bytes:
    """msgpack of ``PutMessage(frame)`` up to the frame's bytes, as `_put_prefix` (tested against msgspec)."""
    return b"\x92\xaaPutMessage" + _bin_header(n)


def _group_prefix(n: int) -> bytes:
    """msgpack of ``PutGroup(frames)`` up to its first frame: a 2-array of the tag and an n-array."""
    return b"\x92\xa8PutGroup" + (bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big"))


def encode_record(rec: Record) -> bytes:
    payload = _encoder.encode(rec)
    return HEADER.pack(len(payload), checksum(payload)) + payload


@dataclass
class ReplayReport:
    records: int = 0
    corrupt_regions: list[tuple[str, int, int]] = field(default_factory=list)  # (file, start, length)

    @property
    def corrupt_bytes(self) -> int:
        return sum(n for _, _, n in self.corrupt_regions)


def read_segment(path: Path, report: ReplayReport) -> tuple[list[Record], int]:
    """All good records of one segment and the offset just after the last good one."""
    data = path.read_bytes()
    view = memoryview(data)  # records are checked and decoded in place (a Put's frame is copied out)
    out: list[Record] = []
    pos = 0
    good_end = 0
    bad_start = -1
    while pos + HEADER.size <= len(data):
        length, crc = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + length
        ok = length <= MAX_RECORD and end <= len(data) and checksum(view[pos + HEADER.size : end]) == crc
        rec: Record | None = None
        if ok:
            try:
                rec = _decoder.decode(view[pos + HEADER.size : end])
            except msgspec.MsgspecError:
                pass
        if rec is None:  # its length, checksum or payload is bad
            if bad_start < 0:
                bad_start = pos
            pos += 1  # resynchronise byte by byte
            continue
        if bad_start >= 0:
            report.corrupt_regions.append((path.name, bad_start, pos - bad_start))
            bad_start = -1
        out.append(rec)
        pos = end
        good_end = end
    if bad_start >= 0 or good_end < len(data):
        start = bad_start if bad_start >= 0 else good_end
        report.corrupt_regions.append((path.name, start, len(data) - start))
    report.records += len(out)
    return out, good_end


class WriteAheadLog:
    """Appends records; `sync()` makes everything appended so far durable per the fsync policy."""

    def __init__(self, directory: str | os.PathLike[str], fsync: str = "batch") -> None:
        if fsync not in ("always", "batch", "never"):
            raise ValueError(f"fsync must be 'always', 'batch' or 'never', got {fsync!r}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync_policy = fsync
        self._file: io.FileIO | None = None
        self._segment = 0
        self.bytes_written = 0  # size of the current segment
        self.appended_total = 0  # bytes appended by this process (diagnostics)
        self.compacted_size = 0  # size of the segment the last compaction wrote
        self._pending: list[bytes | memoryview] = []  # appended records (as pieces) not yet handed to the file
        self._pending_bytes = 0
        self._prefixes: dict[int, bytes] = {}  # frame length -> msgpack prefix of Put(frame)
        self._file_lock = threading.Lock()  # a Syncer's fsync against closing / replacing the file

    # ------------------------------------------------------------------ segments

    def segments(self) -> list[Path]:
        return sorted(self.dir.glob("wal-*.log"), key=lambda p: int(p.stem.split("-")[1]))

    def replay(self) -> tuple[list[Record], ReplayReport]:
        """Every live record, oldest first; older garbage segments are deleted; the current segment is
        truncated after its last good record and opened for appending."""
        report = ReplayReport()
        segs = self.segments()
        for p in self.dir.glob("wal-*.log.tmp"):
            p.unlink()  # an interrupted compaction
        records: list[Record] = []
        start = 0
        parsed: list[tuple[Path, list[Record], int]] = []
        for i, seg in enumerate(segs):
            recs, good_end = read_segment(seg, report)
            parsed.append((seg, recs, good_end))
            if recs and isinstance(recs[0], Snapshot):
                start = i
        for seg, _, _ in parsed[:start]:
            seg.unlink()
        for _, recs, _ in parsed[start:]:
            records.extend(recs)
        if report.corrupt_regions:
            log.warning("write-ahead log: skipped %d corrupt bytes in %s", report.corrupt_bytes, report.corrupt_regions)
        if parsed[start:]:
            last, _, good_end = parsed[-1]
            with open(last, "r+b") as f:
                f.truncate(good_end)
            self._segment = int(last.stem.split("-")[1])
            self._file = open(last, "ab", buffering=0)
            self.bytes_written = good_end
        else:
            self._open_new(1)
        return records, report

    def _open_new(self, n: int) -> None:
        self._segment = n
        self._file = open(self.dir / f"wal-{n:08d}.log", "ab", buffering=0)
        self.bytes_written = 0

    # ------------------------------------------------------------------ writing

    def append(self, rec: Record) -> None:
        """Queue `rec` for the file; `flush`/`sync` write what is queued."""
        if type(rec) is Put:
            self.append_put(rec.frame)
            return
        if self._file is None:
            self._open_new(1)
        data = encode_record(rec)
        self._pending.append(data)
        self._added(len(data))

    def append_message(self, frame: bytes | memoryview) -> None:
        """`append(PutMessage(frame))`: a whole group as it arrived, one record of two or three pieces
        (no piece per member, nothing copied when it is large)."""
        self.append_put(frame, _message_prefix)

    def append_put(self, frame: bytes | memoryview, _prefix: Any = None) -> None:
        """`append(Put(frame))`, the hot path: the msgpack prefix for the frame's length comes from a
        small cache, and the record is written as two pieces (header, prefix + frame)."""
        if self._file is None:
            self._open_new(1)
        n = len(frame)
        if _prefix is not None or n >= _JOIN_LIMIT:  # a large frame is not copied: three pieces, checksum streamed over two
            prefix = (_prefix or _put_prefix)(n)
            h = xxh3_64(prefix)
            h.update(frame)
            self._pending += (HEADER.pack(len(prefix) + n, h.intdigest() & 0xFFFFFFFF), prefix, frame)
            self._added(HEADER.size + len(prefix) + n)
            return
        prefix = self._prefixes.get(n)
        if prefix is None:
            if len(self._prefixes) >= 4096:
                self._prefixes.clear()
            prefix = self._prefixes[n] = _put_prefix(n)
        payload = prefix + frame
        self._pending += (HEADER.pack(len(payload), checksum(payload)), payload)
        self._added(HEADER.size + len(payload))

    def append_group(self, bodies: list, preamble: bytes) -> None:
        """`append(PutGroup([preamble + b for b in bodies]))` without joining anything: the record goes to
        writev as pieces (the bodies are views into the received message) and its checksum is streamed."""
        if self._file is None:
            self._open_new(1)
        if len(bodies) >= 1 << 16:
            raise ValueError(f"a group record holds at most 65535 trajectories, not {len(bodies)}")
        pieces = [_group_prefix(len(bodies))]
        for body in bodies:
            pieces += (_bin_header(len(preamble) + len(body)) + preamble, body)
        h = xxh3_64()
        size = 0
        for piece in pieces:
            h.update(piece)
            size += len(piece)
        self._pending += (HEADER.pack(size, h.intdigest() & 0xFFFFFFFF), *pieces)
        self._added(HEADER.size + size)

    def _added(self, size: int) -> None:
        self._pending_bytes += size
        self.bytes_written += size
        self.appended_total += size
        if self.fsync_policy == "always":
            self.sync()
        elif self._pending_bytes >= _PENDING_LIMIT:
            self._write_pending()

    def _write_pending(self) -> None:
        """Hand the queued pieces to the OS with writev, up to IOV_MAX at a time: one system call for
        hundreds of records, and no copy through a userspace buffer (the file is unbuffered)."""
        pending = self._pending
        if not pending:
            return
        assert self._file is not None  # pieces are queued only once a segment is open
        fd = self._file.fileno()
        for i in range(0, len(pending), _IOV_MAX):
            chunk = pending[i : i + _IOV_MAX]
            written = os.writev(fd, chunk)
            expected = sum(map(len, chunk))
            if written != expected:  # a short write (rare on files): the rest, piece by piece
                rest = memoryview(b"".join(chunk))[written:]
                while rest:
                    rest = rest[os.write(fd, rest):]
        pending.clear()
        self._pending_bytes = 0

    def flush(self) -> None:
        """Hand appended records to the OS: they survive a crash of this process, not a power loss."""
        if self._file is not None:
            self._write_pending()
            self._file.flush()

    def sync(self) -> None:
        """Flush to the OS; fsync unless the policy is "never" (then data survives a process crash but
        not a power loss)."""
        if self._file is None:
            return
        self._write_pending()
        self._file.flush()
        if self.fsync_policy != "never":
            os.fsync(self._file.fileno())

    def fsync_now(self) -> None:
        """fsync what was already handed to the OS (thread-safe against appends; see `Syncer`)."""
        with self._file_lock:
            if self._file is not None:
                os.fsync(self._file.fileno())

    def compact(self, live: Iterator[Record]) -> None:
        """Write a new segment holding only `live` (which starts with a Snapshot), then drop the old ones."""
        n = self._segment + 1
        final = self.dir / f"wal-{n:08d}.log"
        tmp = final.with_name(final.name + ".tmp")
        size = 0
        with open(tmp, "wb") as f:
            for rec in live:
                data = encode_record(rec)
                f.write(data)
                size += len(data)
            f.flush()
            os.fsync(f.fileno())
        old = self.segments()
        self._pending.clear()  # records not yet written are part of the snapshot just made durable
        self._pending_bytes = 0
        with self._file_lock:
            if self._file is not None:
                self._file.close()
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            for seg in old:
                seg.unlink()
            self._segment = n
            self._file = open(final, "ab", buffering=0)
        self.bytes_written = size
        self.compacted_size = size

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            with self._file_lock:
                self._file.close()
                self._file = None


class Syncer:
    """fsync on a thread of its own, so the service keeps ingesting while the disk works (group commit
    whose effects wait for durability). `request()` covers everything written to the file so far and
    returns a token; `done` is the newest token made durable. `fd` becomes readable after each sync:
    poll it to wake up. `wait()` blocks until every request is done (before the file is closed or
    replaced)."""

    def __init__(self, log: WriteAheadLog) -> None:
        self._log = log
        self._cond = threading.Condition()
        self.requested = 0
        self.done = 0
        self.error: OSError | None = None
        self.fd, self._wake = os.pipe()
        os.set_blocking(self.fd, False)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tidal-wal-fsync", daemon=True)
        self._thread.start()

    def request(self) -> int:
        """Sync everything handed to the OS so far (call `log.flush()` first)."""
        with self._cond:
            self.requested += 1
            self._cond.notify()
            return self.requested

    def _run(self) -> None:
        while True:
            with self._cond:
                while self.done == self.requested and not self._stop:
                    self._cond.wait()
                if self._stop and self.done == self.requested:
                    return
                target = self.requested
            try:
                self._log.fsync_now()
            except OSError as e:  # surfaced by the service: acknowledging would be a lie
                self.error = e
            with self._cond:
                self.done = target
                self._cond.notify_all()
            os.write(self._wake, b"x")

    def clear_wakeups(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def wait(self) -> None:
        with self._cond:
            while self.done != self.requested:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(10)
        os.close(self.fd)
        os.close(self._wake)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
