"""torch.distributed transport: buckets are broadcast from the trainer (rank 0) to every generator over
a dedicated process group of its own (a TCPStore rendezvous at `address`), independent of any group
the trainer or the generators already use. gloo on CPU; NCCL when the buckets live on GPUs.

This is a collective: every receiver must take every announced version, in order (as with NCCL
weight sync in other RL stacks). The sender broadcasts from a background thread, so `send()` returns
the announcement at once and the broadcast proceeds while receivers join it. A receiver takes the
buckets in a thread of its own, one ahead of the caller, so bucket k+1 arrives while bucket k is
checked, and verifies and applies them where they arrived (no copy of its own).

Buckets of weights on GPUs (`device="cuda..."`, NCCL or gloo) never visit the host: the sender packs
them in GPU memory of its own (two sets, used in turn: one may still be broadcasting while the next
version is packed) and checksums them there with `mix64-sum`; receivers check each bucket with
`mix64-sum` in the GPU buffer it arrived in (device.py, as `cuda_ipc` does). `verify_on_device=True`
selects the same path for host tensors (the tests run it over gloo on CPU); False keeps host packing
with xxh3 (buckets then cross to the device and back).

Receivers join a version's broadcast only once its announcement reaches them, so the broadcast cannot
start while the sender still packs: that would need receivers listening between updates, and a thread
left blocked in a gloo collective aborts its process at exit ("terminate called without an active
exception") when the collective completes during interpreter shutdown; gloo's abort() does not free it.
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
from tidal.weight_sync.device import MIX64, reusing_allocator
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


class DistSenderTransport:
    name = "torch_dist"

    def __init__(self, address: str, world_size: int, *, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 300.0, verify_on_device: bool | None = None) -> None:
        device = _resolve(device)
        self.address, self.world_size, self.backend, self.device = address, world_size, backend, device
        if _on_device(device, verify_on_device):
            # WeightSender packs into `allocator()`'s buffers on this device, checksummed there
            self.pack_device = torch.device(device)
            self.checksum = MIX64
            self.allocator = self._device_allocator
        self._slots: list[dict[int, torch.Tensor]] = [{}, {}]
        self._staged = 0
        self._pg: Any = None
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(timeout_s,), name="tidal-weight-broadcast", daemon=True)
        self._thread.start()

    def _run(self, timeout_s: float) -> None:
        try:
            self._pg = _group(self.address, 0, self.world_size, self.backend, timeout_s)
            while True:
                job = self._jobs.get()
                if job is None:
                    self._jobs.task_done()
                    return
                version, buckets = job
                try:
                    self._broadcast_version(version, buckets)
                finally:
                    self._jobs.task_done()
        except BaseException as e:  # surfaced on the next stage() / close()
            self._error = e

    def _device_allocator(self):
        """Where the sender packs the next version (the device path's `allocator`). Two sets in turn:
        `stage` lets a version go only once the one before it was broadcast, so the set used by the
        version before that one is free (a failed send staged nothing: its set is used again)."""
        return reusing_allocator(self._slots[self._staged % 2], self.pack_device)

    def _broadcast_version(self, version: int, buckets: list[Bucket]) -> None:
        _enter(self.device)
        header = torch.tensor([version, len(buckets)], dtype=torch.int64, device=self.device)
        _broadcast(self._pg, header)
        for b in buckets:
            data = b.data if isinstance(b.data, torch.Tensor) else torch.from_numpy(b.data)
            _broadcast(self._pg, data.to(self.device))

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        if self._error is not None:
            raise WeightSyncError(f"weight broadcast failed: {self._error}")
        # at most one version in flight: its buckets are still being broadcast from our buffers
        while self._jobs.unfinished_tasks:
            if self._error is not None or not self._thread.is_alive():
                raise WeightSyncError(f"weight broadcast failed: {self._error}")
            time.sleep(0.001)
        self._jobs.put((version, buckets))
        self._staged += 1
        return self.address

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)


class DistReceiverTransport:
    name = "torch_dist"
    # a version's buckets stay in their receive buffers until the next version's broadcast, which only
    # starts at the next fetch: the receiver verifies and applies them in place
    zero_copy = True

    def __init__(self, address: str, rank: int, world_size: int, *, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 300.0, verify_on_device: bool | None = None) -> None:
        if rank < 1:
            raise ValueError("receivers take ranks 1..world_size-1; rank 0 is the sender")
        device = self.device = _resolve(device)
        # hand over the receive buffers themselves (checked with mix64-sum where they are) rather than
        # host copies of them
        self.on_device = _on_device(device, verify_on_device)
        self.timeout_s = timeout_s
        self._taker: threading.Thread | None = None  # takes the buckets of the version being fetched
        self._buffers: dict[int, torch.Tensor] = {}  # bucket index -> receive buffer, reused across versions
        self._pg = _group(address, rank, world_size, backend, timeout_s)

    def fetch(self, ann: WeightsAvailable, have_version: int) -> Iterator[tuple[int, str, int, Any]]:
        if self._taker is not None and self._taker.is_alive():
            raise WeightSyncError("the previous version's broadcast is still being taken; it did not finish in time")
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        _broadcast(self._pg, header)
        version, n = (int(x) for x in header.tolist())
        if version != ann.version or n != len(ann.bucket_sizes):
            raise WeightSyncError(f"broadcast carries version {version} ({n} buckets) but the announcement is "
                                  f"version {ann.version} ({len(ann.bucket_sizes)} buckets): receivers must take "
                                  "every version, in order, on a collective transport")
        arrived: queue.Queue = queue.Queue(maxsize=1)  # one bucket ahead: bounds the memory in flight
        give_up = threading.Event()

        def take() -> None:  # every bucket must be taken, even after the caller gave up: it is a collective
            try:
                _enter(self.device)
                for i, size in enumerate(ann.bucket_sizes):
                    # bucket i of the previous version was applied before this version began: its
                    # memory is reused (fresh memory costs page faults, more than a copy)
                    t = self._buffers.get(i)
                    if t is None or t.numel() != size:
                        t = self._buffers[i] = torch.empty(size, dtype=torch.uint8, device=self.device)
                    _broadcast(self._pg, t)
                    if not give_up.is_set():
                        arrived.put((i, t))
            except BaseException as e:
                if not give_up.is_set():
                    arrived.put((-1, e))

        self._taker = threading.Thread(target=take, name="tidal-weight-take", daemon=True)
        self._taker.start()
        try:
            for _ in ann.bucket_sizes:
                try:
                    i, t = arrived.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise WeightSyncError(f"bucket of version {ann.version} did not arrive within {self.timeout_s:g} s") from None
                if i < 0:
                    raise WeightSyncError(f"weight broadcast of version {ann.version} failed: {t}")
                yield i, "dense", -1, (t if self.on_device else t.cpu().numpy() if t.device.type != "cpu" else t.numpy())
        finally:  # given up part way (a bad bucket): the rest of the version is taken, and dropped
            give_up.set()
            while True:
                try:
                    arrived.get_nowait()
                except queue.Empty:
                    break
            self._taker.join(self.timeout_s)

    def release(self, ann: WeightsAvailable) -> None:
        pass  # the buffers are written again by the next fetch only

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        pass

    def close(self) -> None:
        pass


__all__ = ["DistReceiverTransport", "DistSenderTransport"]
