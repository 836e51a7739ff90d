"""Where the learner's batches come from: the `BatchSource` seam.

A source hands this rank its share of the next batch (`next`), can ask for the one after while a step
trains (`prefetch`), and takes the acknowledgements of trained batches (`ack_later`: sent with the next
request; `ack_now`: sent and confirmed now). Three sources:

- `BufferSource`: the buffer, through a client such as tidal-buffer's `BatchClient`, one request per step, the next one asked for
  on a thread of its own while the step trains (one process) so a batch the buffer already holds costs
  the step nothing.
- `ReplaySource`: the batches a learner trained on and recorded (`learner.record_batches`), in order,
  without a buffer: the same run trained again (another loss, another learning rate) on the same data.
- `FollowerSource`: a sequence-parallel rank that is not its group's 0, which gets its share from that
  rank (`SequenceParallel.share`) and asks nothing itself.

A recording is one folder with a file per data-parallel rank (`batches-<rank>.msgpack`), each a sequence of
length-prefixed msgpack `Batch` messages (tidal-core's protocol, the buffer's own reply).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import msgspec

from tidal.core.errors import ChannelTimeout, ConfigError
from tidal.core.protocol import Batch

log = logging.getLogger("tidal.learner")

# a batch's trajectories -> what the trainer steps on; `full`: also the work a step could do ahead of time
Prepare = Callable[[Batch, bool], Any]


class BatchClientLike(Protocol):
    """A buffer client: this rank's share of the next batch (acknowledging `ack` with the request), an
    ack on its own, close. tidal-buffer's `BatchClient` is one."""

    def next_batch(self, version: int, timeout: float = ..., ack: list[str] | None = None) -> Batch: ...

    def ack(self, batch_ids: list[str], timeout: float = ...) -> None: ...

    def close(self) -> None: ...


class Fetched(NamedTuple):
    batch: Batch | None  # None on a follower rank
    work: Any  # the trainer's input, made from the batch by `Prepare`
    asked_at: float  # time.time() when it was requested


class BatchSource(Protocol):
    prefetching: bool  # a request may be on its way while a step trains (so `ack_later` costs nothing)

    def next(self, version: int) -> Fetched | None:
        """This rank's share of the next batch, to be trained at `version`; None once stopped (or the
        source is exhausted)."""
        ...

    def prefetch(self, version: int) -> None:
        """Ask for the batch after the one being trained now, to be trained at `version`."""
        ...

    def ack_later(self, batch_ids: Iterable[str]) -> None:
        """Acknowledge `batch_ids` with the next request."""
        ...

    def ack_now(self, batch_ids: Iterable[str]) -> bool:
        """Acknowledge what `ack_later` holds and `batch_ids` now; False when stopped unconfirmed."""
        ...

    def close(self) -> None: ...


def until_stopped(call: Callable[[float], Any], timeout: float, what: str,
                  stopped: Callable[[], bool]) -> tuple[bool, Any]:
    """`call(slice_timeout)` in slices of at most 2 s until it returns, so that a stop request is seen
    while the buffer is quiet or gone: (True, result), or (False, None) once stopped. ChannelTimeout
    naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return True, call(min(2.0, max(0.01, deadline - time.monotonic())))
        except ChannelTimeout:
            if stopped():
                return False, None
            if time.monotonic() >= deadline:
                raise ChannelTimeout(f"{what} within {timeout:g} s") from None


class BufferSource:
    """Batches from the buffer. With `prefetch`, every request and ack goes through one thread of its
    own (a ZeroMQ socket is used by one thread only), in order."""

    def __init__(self, client: BatchClientLike, prepare: Prepare, *, timeout_s: float, stopped: Callable[[], bool],
                 prefetch: bool) -> None:
        self.client, self.prepare, self.timeout_s, self.stopped = client, prepare, timeout_s, stopped
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-learner-fetch") if prefetch else None
        self.prefetching = prefetch
        self._next: Future | None = None
        self._acks: list[str] = []

    def next(self, version: int) -> Fetched | None:
        fut, self._next = self._next, None
        if self._thread is None:
            return self._fetch(self._take_acks(), version, False)
        return (fut if fut is not None else self._thread.submit(self._fetch, self._take_acks(), version, False)).result()

    def prefetch(self, version: int) -> None:
        if self._thread is not None:
            self._next = self._thread.submit(self._fetch, self._take_acks(), version, True)

    def ack_later(self, batch_ids: Iterable[str]) -> None:
        self._acks.extend(batch_ids)

    def ack_now(self, batch_ids: Iterable[str]) -> bool:
        ids = self._take_acks() + list(batch_ids)
        if not ids:
            return True
        client = self.client

        def ack() -> tuple[bool, Any]:
            return until_stopped(lambda t: client.ack(ids, timeout=t), 60.0,
                                 f"the buffer did not confirm the ack of {', '.join(ids[:3])}", self.stopped)

        # prefetching: on the client's thread, after the request in flight (stopped, it ends within 2 s)
        acked, _ = self._thread.submit(ack).result() if self._thread is not None else ack()
        if not acked:
            log.warning("stopping before the buffer confirmed the ack of %d batches (recorded as trained)", len(ids))
        return bool(acked)

    def _take_acks(self) -> list[str]:
        ids, self._acks = self._acks, []
        return ids

    def _fetch(self, ack: list[str], version: int, full: bool) -> Fetched | None:
        """On the fetch thread when prefetching."""
        asked_at = time.time()
        client = self.client
        got, batch = until_stopped(lambda t: client.next_batch(version, timeout=t, ack=ack), self.timeout_s,
                                   "no batch from the buffer", self.stopped)
        if not got:
            return None
        return Fetched(batch, self.prepare(batch, full), asked_at)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self.client.close()


class FollowerSource:
    """A sequence-parallel rank other than its group's 0: its share comes from that rank."""

    prefetching = False

    def next(self, version: int) -> Fetched | None:
        return Fetched(None, [], time.time())

    def prefetch(self, version: int) -> None:
        pass

    def ack_later(self, batch_ids: Iterable[str]) -> None:
        pass

    def ack_now(self, batch_ids: Iterable[str]) -> bool:
        return True

    def close(self) -> None:
        pass


_LEN = struct.Struct("<I")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Batch)


def recording_file(folder: str | Path, dp_rank: int) -> Path:
    return Path(folder) / f"batches-{dp_rank}.msgpack"


class BatchRecorder:
    """Appends each batch this rank trains on to its recording file, as the buffer sent it."""

    def __init__(self, folder: str | Path, dp_rank: int) -> None:
        path = recording_file(folder, dp_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")  # open for the learner's life, closed by close()

    def write(self, batch: Batch) -> None:
        body = _ENCODER.encode(batch)
        self._file.write(_LEN.pack(len(body)) + body)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_recording(path: Path) -> Iterable[Batch]:
    """The batches of one recording file, in order; a record cut short by a crash ends it."""
    with open(path, "rb") as f:
        while len(head := f.read(_LEN.size)) == _LEN.size:
            body = f.read(_LEN.unpack(head)[0])
            try:
                yield _DECODER.decode(body)
            except msgspec.DecodeError:
                log.warning("%s: a record cut short ends the recording here", path)
                return


class ReplaySource:
    """The batches recorded by an earlier learner, in order, this rank's file. A batch recorded twice
    (served again after the recording learner was killed between checkpoints) is trained once, and the
    first `done` batches (the steps of the checkpoint resumed from) are skipped. Exhausted, `next` returns
    None: the learner stops as if asked to."""

    def __init__(self, folder: str | Path, dp_rank: int, dp: int, prepare: Prepare, done: int = 0) -> None:
        path = recording_file(folder, dp_rank)
        if not path.is_file():
            have = sorted(p.name for p in Path(folder).glob("batches-*.msgpack")) if Path(folder).is_dir() else []
            raise ConfigError(f"learner.source: no recording {path} for data-parallel rank {dp_rank} of {dp}"
                              f" (found: {', '.join(have) or 'nothing'}); record one with learner.record_batches, and"
                              f" replay it with as many data-parallel ranks as recorded it", field="learner.source")
        self.path, self.prepare = path, prepare
        self._seen: set[str] = set()
        self._done = done
        self.prefetching = False
        self._batches = iter(read_recording(path))
        self.served = 0

    def next(self, version: int) -> Fetched | None:
        for batch in self._batches:
            if batch.batch_id in self._seen:
                continue
            self._seen.add(batch.batch_id)
            if len(self._seen) > self._done:
                self.served += 1
                return Fetched(batch, self.prepare(batch, False), time.time())
        log.info("replay of %s finished after %d batches", self.path, self.served)
        return None

    def prefetch(self, version: int) -> None:
        pass

    def ack_later(self, batch_ids: Iterable[str]) -> None:
        pass  # nothing to tell: the recording stays as it is

    def ack_now(self, batch_ids: Iterable[str]) -> bool:
        return True

    def close(self) -> None:
        pass
