"""torch.distributed transport: buckets are broadcast from the trainer (rank 0) to every generator over
a dedicated process group of its own (a TCPStore rendezvous at `address`), independent of any group
the trainer or the generators already use. gloo on CPU; NCCL when the buckets live on GPUs.

This is a collective: every receiver must take every announced version, in order (as with NCCL
weight sync in other RL stacks). The broadcast streams: each bucket goes out from a background thread
as soon as it is packed, while the sender packs the next, and each receiver takes the stream in a
background thread of its own from the moment it joins, so most of a version has arrived by the time its
announcement does. Every bucket is preceded by a header [version, attempt, index, nbytes] (index -1:
the version is complete with nbytes buckets; -2: abandoned part way, e.g. a tensor of an unsupported
dtype; -3: the sender closed). `attempt` counts the versions streamed, aborted ones included, and the
announcement's location names it (``host:port#attempt``), so a receiver skips an abandoned attempt even
when the version is sent again. The receiver checks what arrived against the announcement's sizes and
checksums before anything is applied.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync.buckets import Bucket
from tidal.weight_sync.errors import WeightSyncError


def _group(address: str, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def _broadcast(pg: Any, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()


END, ABORT, CLOSE = -1, -2, -3  # header index values that are not buckets


class DistSenderTransport:
    name = "torch_dist"

    def __init__(self, address: str, world_size: int, *, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 300.0) -> None:
        self.address, self.world_size, self.backend, self.device = address, world_size, backend, device
        self._pg: Any = None
        self._error: BaseException | None = None
        self._streaming = -1  # the version whose buckets are going out
        self._attempt = 0  # streams started: tags every header, so receivers can tell retries apart
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(timeout_s,), name="tidal-weight-broadcast", daemon=True)
        self._thread.start()

    def _run(self, timeout_s: float) -> None:
        try:
            self._pg = _group(self.address, 0, self.world_size, self.backend, timeout_s)
            if self.device.startswith("cuda"):
                torch.cuda.set_device(torch.device(self.device))
            while True:
                version, attempt, index, bucket = self._jobs.get()
                try:
                    n = bucket.nbytes if index >= 0 else (bucket if index == END else 0)
                    header = torch.tensor([version, attempt, index, n], dtype=torch.int64, device=self.device)
                    _broadcast(self._pg, header)
                    if index >= 0:
                        _broadcast(self._pg, torch.from_numpy(bucket.data).to(self.device))
                finally:
                    self._jobs.task_done()
                if index == CLOSE:
                    return
        except BaseException as e:  # surfaced on the next stage() / close()
            self._error = e

    def _idle(self) -> None:
        """Wait until everything queued has gone out: the last version's buffers may then be reused."""
        while self._jobs.unfinished_tasks:
            if self._error is not None or not self._thread.is_alive():
                raise WeightSyncError(f"weight broadcast failed: {self._error}")
            time.sleep(0.001)

    def stage_bucket(self, version: int, bucket: Bucket) -> None:
        if self._error is not None:
            raise WeightSyncError(f"weight broadcast failed: {self._error}")
        if version != self._streaming:  # at most one version in flight: its buckets are our buffers
            self._idle()
            self._streaming = version
            self._attempt += 1
        self._jobs.put((version, self._attempt, bucket.index, bucket))

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        if version != self._streaming:  # nothing streamed yet (no buckets, or called directly)
            self._idle()
            self._streaming = version
            self._attempt += 1
            for b in buckets:
                self._jobs.put((version, self._attempt, b.index, b))
        self._jobs.put((version, self._attempt, END, len(buckets)))
        self._streaming = -1
        return f"{self.address}#{self._attempt}"

    def abort(self, version: int) -> None:
        if self._streaming == version:
            self._jobs.put((version, self._attempt, ABORT, None))
            self._streaming = -1

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put((-1, self._attempt, CLOSE, None))  # tells the receivers' threads to stop listening
        self._thread.join(5)


class DistReceiverTransport:
    name = "torch_dist"

    def __init__(self, address: str, rank: int, world_size: int, *, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 300.0) -> None:
        if rank < 1:
            raise ValueError("receivers take ranks 1..world_size-1; rank 0 is the sender")
        self.device = device
        self.timeout_s = timeout_s
        self._pg = _group(address, rank, world_size, backend, timeout_s)
        self._events: queue.Queue = queue.Queue()  # (kind, version, attempt, index or count, tensor)
        self._held: tuple | None = None  # an event read ahead of the version asked for
        self._taken = threading.Event()  # the last complete version was taken: listen for the next
        self._taken.set()
        self._stop = False
        self._thread = threading.Thread(target=self._listen, name="tidal-weight-listen", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        """Take the broadcast stream as it comes, at most one complete version ahead of `fetch`."""
        try:
            if self.device.startswith("cuda"):
                torch.cuda.set_device(torch.device(self.device))
            while not self._stop:
                header = torch.zeros(4, dtype=torch.int64, device=self.device)
                _broadcast(self._pg, header)
                version, attempt, index, n = (int(x) for x in header.tolist())
                if index == CLOSE:
                    self._events.put(("closed", version, attempt, 0, None))
                    return
                if index >= 0:
                    t = torch.empty(n, dtype=torch.uint8, device=self.device)
                    _broadcast(self._pg, t)
                    self._events.put(("bucket", version, attempt, index, t))
                elif index == END:
                    self._taken.clear()
                    self._events.put(("end", version, attempt, n, None))
                    self._taken.wait()
                else:
                    self._events.put(("abort", version, attempt, 0, None))
        except BaseException as e:
            self._events.put(("error", -1, -1, 0, e))

    def _next(self, ann: WeightsAvailable) -> tuple:
        if self._held is not None:
            ev, self._held = self._held, None
            return ev
        try:
            return self._events.get(timeout=self.timeout_s)
        except queue.Empty:
            raise WeightSyncError(f"no broadcast of version {ann.version} arrived within {self.timeout_s:g} s") from None

    def fetch(self, ann: WeightsAvailable, have_version: int) -> Iterator[tuple[int, str, int, Any]]:
        _, _, tag = ann.location.rpartition("#")
        if not tag.isdigit():
            raise WeightSyncError(f"announcement location {ann.location!r} lacks the '#attempt' this transport adds")
        want = int(tag)
        while True:
            kind, version, attempt, k, t = self._next(ann)
            if kind == "error":
                raise WeightSyncError(f"weight broadcast failed: {t}")
            if kind == "closed" or attempt > want:
                self._held = (kind, version, attempt, k, t)
                raise WeightSyncError(f"version {ann.version} (attempt {want}) was not broadcast to this receiver (the "
                                      f"broadcast is at version {version}, attempt {attempt}{', closed' if kind == 'closed' else ''}): "
                                      "receivers must take every version, in order, on a collective transport")
            if attempt < want:  # abandoned, or a version whose announcement never reached us: dropped
                if kind == "end":
                    self._taken.set()
                continue
            if version != ann.version:
                raise WeightSyncError(f"broadcast attempt {want} carries version {version}, the announcement {ann.version}")
            if kind == "abort":
                raise WeightSyncError(f"the sender abandoned version {version} part way")
            if kind == "end":
                self._taken.set()
                if k != len(ann.bucket_sizes):
                    raise WeightSyncError(f"broadcast of version {version} carried {k} buckets, the announcement "
                                          f"{len(ann.bucket_sizes)}")
                return
            yield k, "dense", -1, (t.cpu().numpy() if t.device.type != "cpu" else t.numpy())

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        pass

    def close(self) -> None:
        # the listener stops at the sender's close; if the sender is gone it ends with the process
        self._stop = True
        self._taken.set()


__all__ = ["DistReceiverTransport", "DistSenderTransport"]
