"""torch.distributed transport: buckets are broadcast from the trainer (rank 0) to every generator over
a dedicated process group of its own (a TCPStore rendezvous at `address`), independent of any group
the trainer or the generators already use. gloo on CPU; NCCL when the buckets live on GPUs.

This is a collective: every receiver takes every broadcast version, in order (as with NCCL weight sync
in other RL stacks). The broadcast of a version starts with its first packed bucket, while the sender
still packs the next ones: `send()` returns the announcement once the last bucket is packed, and the
broadcast is by then mostly done. For that a receiver takes each version as it is broadcast, in a
thread of its own, before its announcement reaches it: the sender sets one TCPStore key per receiver
when a version begins ("r<rank>/<n>", n counting the broadcasts), the thread waits on its key there
(not in a collective: a thread left blocked in a gloo collective aborts its process at exit, "terminate
called without an active exception", and gloo's abort() does not free it), then joins the broadcast:
for each bucket a small header (broadcast number, version, bucket index, size) and the bucket, received
into a buffer of the transport's own, then an end header with the bucket count (-1: the sender gave the
version up part way). `fetch(announcement)` checks and hands over the buckets where they arrived (no
copy of its own); the thread writes them again only once `release` says the version was applied (or
given up), so each version arrives in the buffers of the one before it. `close()` wakes the waiting
thread through its own key.

Buckets of weights on GPUs (`device="cuda..."`, NCCL or gloo) never visit the host: the sender packs
them in GPU memory of its own (two sets, used in turn: one may still be broadcasting while the next
version is packed) and checksums them there with `mix64-sum`; receivers check each bucket with
`mix64-sum` in the GPU buffer it arrived in (device.py, as `cuda_ipc` does). `verify_on_device=True`
selects the same path for host tensors (the tests run it over gloo on CPU); False keeps host packing
with xxh3 (buckets then cross to the device and back).
"""

from __future__ import annotations

import datetime
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync.buckets import Bucket
from tidal.weight_sync.device import MIX64, reusing_allocator
from tidal.weight_sync.errors import WeightSyncError
from tidal.weight_sync.transport_base import ReceiverTransport, SenderTransport

_END = -1  # the bucket index of a version's end header
_STOP = b"stop"  # a receiver's key set by its own close()


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host, int(port)


def listening_fd(host: str, port: int) -> int:
    """A socket listening on exactly `host`:`port`, as a descriptor for a TCPStore server to take over
    (``master_listen_fd``; the store closes it). TCPStore itself listens on every interface whatever host
    it is given, so a store meant for loopback would be reachable from the network. SO_REUSEADDR lets it
    join a port held by a `tidal.core.net.PortReservation`."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def _group(address: str, rank: int, world_size: int, backend: str, timeout_s: float) -> tuple[Any, Any]:
    """The rendezvous store (kept: it also carries the per-version keys) and the process group. Rank 0's
    store listens on `address`'s host alone."""
    host, port = _host_port(address)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout,
                          master_listen_fd=listening_fd(host, port) if rank == 0 else None)
    if backend == "gloo":
        return store, dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return store, dist.ProcessGroupNCCL(store, rank, world_size)  # type: ignore[call-arg]  # torch's stub lacks the (store, rank, size, timeout=600 s) overload
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def _key(rank: int, n: int) -> str:
    return f"tidal-weight-sync/r{rank}/{n}"


def _post(pg: Any, t: torch.Tensor) -> Any:
    """Start a broadcast of `t` from rank 0; returns its work (`.wait()` for it)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([t], opts)


def _on_device(device: str, verify_on_device: bool | None) -> bool:
    return device.startswith("cuda") if verify_on_device is None else verify_on_device


def _resolve(device: str) -> str:
    """"cuda" as "cuda:N", N the caller's current GPU: the collectives run in threads of their own,
    which start on GPU 0, and `torch.cuda.set_device` refuses a device without an index."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return device


def _enter(device: str) -> None:
    """Make `device` current in this (collective) thread."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def broadcast_number(ann: WeightsAvailable) -> int:
    """Which broadcast carries `ann`'s buckets: the sender's location is "host:port#n"."""
    _, _, n = ann.location.rpartition("#")
    if not n.isdigit():
        raise WeightSyncError(f"version {ann.version}'s location {ann.location!r} names no broadcast "
                              "(host:port#n); it was not announced by this torch_dist sender")
    return int(n)


class DistSenderTransport(SenderTransport):
    streams = True  # stage_bucket starts on each bucket as it is packed
    name = "torch_dist"

    def __init__(self, address: str, world_size: int, *, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 300.0, verify_on_device: bool | None = None) -> None:
        device = _resolve(device)
        _host_port(address)
        self.address, self.world_size, self.backend, self.device = address, world_size, backend, device
        self.timeout_s = timeout_s
        if _on_device(device, verify_on_device):
            # WeightSender packs into `allocator()`'s buffers on this device, checksummed there
            self.pack_device = torch.device(device)
            self.checksum = MIX64
        self._slots: list[dict[int, torch.Tensor]] = [{}, {}]
        self._staged = 0  # versions announced
        self._begun = 0  # broadcasts begun (given-up ones too); the next one's number
        self._open: int | None = None  # the version whose buckets are being streamed
        self._done = 0  # broadcasts finished by the thread
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(timeout_s,), name="tidal-weight-broadcast", daemon=True)
        self._thread.start()

    def _run(self, timeout_s: float) -> None:
        try:
            store, pg = _group(self.address, 0, self.world_size, self.backend, timeout_s)
            _enter(self.device)
            # Bucket k+1's header goes out while bucket k is still on the wire (receivers have its
            # receive posted by then), so it arrives right behind it: no round trip between buckets.
            # Two buckets at most in flight; their buffers stay alive in `flight`.
            flight: list[tuple[Bucket, Any]] = []
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                kind, n, version, item = job
                if kind == "begin":  # wake the receivers (their previous key is spent: they took n-1)
                    store.multi_set([_key(r, n) for r in range(1, self.world_size)], [str(version)] * (self.world_size - 1))
                    if n:
                        for r in range(1, self.world_size):
                            store.delete_key(_key(r, n - 1))
                elif kind == "bucket":
                    _post(pg, self._header(n, version, item.index, item.nbytes))
                    data = item.data if isinstance(item.data, torch.Tensor) else torch.from_numpy(item.data)
                    flight.append((item, _post(pg, data.to(self.device))))
                    if len(flight) > 1:
                        flight.pop(0)[1].wait()
                else:  # "end": item is the bucket count, -1 for a version given up
                    end = _post(pg, self._header(n, version, _END, item))
                    for _, work in flight:
                        work.wait()
                    flight.clear()
                    end.wait()
                    with self._cv:
                        self._done = n + 1
                        self._cv.notify_all()
        except BaseException as e:  # surfaced on the next stage / close
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _header(self, n: int, version: int, index: int, size: int) -> torch.Tensor:
        return torch.tensor([n, version, index, size], dtype=torch.int64, device=self.device)

    def allocator(self) -> Callable[[int, int], Any] | None:
        """Where the sender packs the next version: on the device path (`pack_device` set), buffers on this
        device, two sets in turn; None otherwise (the sender's own pool). A version's broadcast begins only
        once the one before it ended, so the set used by the version before that one is free (a version
        given up waits for its broadcast to end: its set is used again)."""
        if self.pack_device is None:
            return None
        return reusing_allocator(self._slots[self._staged % 2], self.pack_device)

    def _wait_done(self, n: int, what: str) -> None:
        """Until broadcasts 0..n-1 ended; raises if the thread failed or did not get there in time."""
        with self._cv:
            ended = self._cv.wait_for(lambda: self._done >= n or self._failed(), timeout=self.timeout_s)
            self._raise_if_failed(what)
            if not ended:
                raise WeightSyncError(f"{what}: the weight broadcast before it did not end within "
                                      f"{self.timeout_s:g} s (a receiver that does not take it?)")

    def _failed(self) -> bool:
        return self._error is not None or not self._thread.is_alive()

    def _raise_if_failed(self, what: str) -> None:
        if self._failed():
            raise WeightSyncError(f"{what}: weight broadcast failed: {self._error or 'the transport is closed'}")

    def _begin(self, version: int) -> None:
        # at most one version in flight: the one before is still broadcast from its own buffers
        self._wait_done(self._begun, f"version {version}")
        self._open = version
        self._jobs.put(("begin", self._begun, version, None))

    def stage_bucket(self, version: int, b: Bucket) -> None:
        """Broadcast bucket `b` now, while the sender packs the next one."""
        if self._open != version:
            self._begin(version)
        self._raise_if_failed(f"version {version}")
        self._jobs.put(("bucket", self._begun, version, b))

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        if self._open != version:  # no buckets at all
            self._begin(version)
        self._raise_if_failed(f"version {version}")
        n = self._begun
        self._jobs.put(("end", n, version, len(buckets)))
        self._open = None
        self._begun += 1
        self._staged += 1
        return f"{self.address}#{n}"

    def abort(self, version: int) -> None:
        """End a version given up part way (its receivers are in its broadcast), and wait for that: the
        next version may pack into the same buffers."""
        if self._open != version:
            return
        self._jobs.put(("end", self._begun, version, -1))
        self._open = None
        self._begun += 1
        try:
            self._wait_done(self._begun, f"giving up version {version}")
        except WeightSyncError:
            pass  # the error that made the sender give up is the one to raise

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)


class DistReceiverTransport(ReceiverTransport):
    name = "torch_dist"
    # a version's buckets stay in their receive buffers until `release`: the receiver verifies and
    # applies them in place
    zero_copy = True

    def __init__(self, address: str, rank: int, world_size: int, *, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 300.0, verify_on_device: bool | None = None) -> None:
        if rank < 1:
            raise ValueError("receivers take ranks 1..world_size-1; rank 0 is the sender")
        device = self.device = _resolve(device)
        # hand over the receive buffers themselves (checked with mix64-sum where they are) rather than
        # host copies of them
        self.on_device = _on_device(device, verify_on_device)
        self.address, self.rank, self.timeout_s = address, rank, timeout_s
        self._buffers: dict[int, torch.Tensor] = {}  # bucket index -> receive buffer, reused across versions
        self._events: queue.Queue = queue.Queue()  # (broadcast n, version, bucket index or _END, tensor or count)
        self._peeked: tuple | None = None  # an event of a later broadcast than the announcement asked for
        self._released = -1  # broadcasts up to this one were applied or given up: their buffers are free
        self._waiting = 0  # the broadcast the thread waits for
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._store, self._pg = _group(address, rank, world_size, backend, timeout_s)
        # close() wakes the thread through a connection of its own: the thread's is busy waiting
        host, port = _host_port(address)
        self._waker = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        self._thread = threading.Thread(target=self._take, name="tidal-weight-take", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        """Take every broadcast as it comes, into the buffers, once the one before was released."""
        try:
            _enter(self.device)
            n = 0
            while True:
                self._waiting = n
                if self._stop.is_set():
                    return
                try:
                    self._store.wait([_key(self.rank, n)], datetime.timedelta(seconds=self.timeout_s))
                except dist.DistStoreError:  # only a timeout: nothing to take yet
                    continue
                if self._store.get(_key(self.rank, n)) == _STOP or self._stop.is_set():
                    return
                header = torch.zeros(4, dtype=torch.int64, device=self.device)
                header_work = _post(self._pg, header)
                while True:
                    header_work.wait()
                    got_n, version, index, size = (int(x) for x in header.tolist())
                    if got_n != n:
                        raise WeightSyncError(f"broadcast {got_n} arrived while broadcast {n} was expected: "
                                              "the sender and this receiver are out of step")
                    if index == _END:
                        self._events.put((n, version, _END, size))
                        break
                    # the version before was released (or this is the first): its memory is reused
                    # (fresh memory costs page faults, more than a copy)
                    t = self._buffers.get(index)
                    if t is None or t.numel() != size:
                        t = self._buffers[index] = torch.empty(size, dtype=torch.uint8, device=self.device)
                    work = _post(self._pg, t)
                    # the next header's receive is posted now: it arrives right behind this bucket
                    header = torch.zeros(4, dtype=torch.int64, device=self.device)
                    header_work = _post(self._pg, header)
                    work.wait()
                    self._events.put((n, version, index, t))
                # the next broadcast writes these buffers: not before this version was applied or given
                # up (a fetch of any later version drops it). Until then the sender's next broadcast
                # waits for this receiver, as a collective does
                with self._cv:
                    while self._released < n and size >= 0 and not self._stop.is_set():
                        self._cv.wait(0.5)
                n += 1
        except BaseException as e:
            if not self._stop.is_set():
                self._events.put((-1, -1, _END, e))

    def _next(self, ann: WeightsAvailable) -> tuple:
        if self._peeked is not None:
            ev, self._peeked = self._peeked, None
            return ev
        try:
            return self._events.get(timeout=self.timeout_s)
        except queue.Empty:
            raise WeightSyncError(f"version {ann.version}'s buckets did not arrive within {self.timeout_s:g} s") from None

    def fetch(self, ann: WeightsAvailable, have_version: int) -> Iterator[tuple[int, str, int, Any]]:
        want = broadcast_number(ann)
        while True:
            ev = self._next(ann)
            n, version, index, item = ev
            if n < 0:
                self._peeked = ev  # for every later fetch too
                raise WeightSyncError(f"weight broadcast failed: {item}")
            if n < want:  # a version this receiver was never asked for, or gave up: dropped
                if index == _END:
                    self.release_broadcast(n)
                continue
            if n > want:
                self._peeked = ev
                raise WeightSyncError(f"version {ann.version} (broadcast {want}) was already dropped: this receiver "
                                      f"is taking version {version} (broadcast {n}); announce that one")
            if version != ann.version:
                raise WeightSyncError(f"broadcast {n} carries version {version} but the announcement is version "
                                      f"{ann.version}: announcements and broadcasts are out of step")
            if index == _END:
                if item != len(ann.bucket_sizes):
                    raise WeightSyncError(f"broadcast of version {ann.version} ended with {item} buckets, the "
                                          f"announcement has {len(ann.bucket_sizes)}" + (" (the sender gave it up)" if item < 0 else ""))
                return
            yield index, "dense", -1, (item if self.on_device else item.cpu().numpy() if item.device.type != "cpu" else item.numpy())

    def release_broadcast(self, n: int) -> None:
        with self._cv:
            self._released = max(self._released, n)
            self._cv.notify_all()

    def release(self, ann: WeightsAvailable) -> None:
        """`ann`'s buckets were applied (or given up): the thread may take the next version into them."""
        self.release_broadcast(broadcast_number(ann))

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        pass

    def close(self) -> None:
        """Stop the thread: it waits for its next key, which we set ourselves."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread.is_alive():
            try:
                self._waker.set(_key(self.rank, self._waiting), _STOP.decode())  # stored as the same bytes
            except Exception:  # the sender's store is gone: the thread's wait fails and it ends by itself
                pass
            self._thread.join(5)


__all__ = ["DistReceiverTransport", "DistSenderTransport"]
