"""torch.distributed transport: buckets are broadcast from the trainer (rank 0) to every generator over
a dedicated process group of its own (a TCPStore rendezvous at `address`), independent of any group
the trainer or the generators already use. gloo on CPU; NCCL when the buckets live on GPUs.

This is a collective: every receiver must take every announced version, in order (as with NCCL
weight sync in other RL stacks). The sender broadcasts from a background thread, so `send()` returns
the announcement at once and the broadcast proceeds while receivers join it.
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


class DistSenderTransport:
    name = "torch_dist"

    def __init__(self, address: str, world_size: int, *, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 300.0) -> None:
        self.address, self.world_size, self.backend, self.device = address, world_size, backend, device
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

    def _broadcast_version(self, version: int, buckets: list[Bucket]) -> None:
        header = torch.tensor([version, len(buckets)], dtype=torch.int64, device=self.device)
        _broadcast(self._pg, header)
        for b in buckets:
            _broadcast(self._pg, torch.from_numpy(b.data).to(self.device))

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        if self._error is not None:
            raise WeightSyncError(f"weight broadcast failed: {self._error}")
        # at most one version in flight: its buckets are still being broadcast from our buffers
        while self._jobs.unfinished_tasks:
            if self._error is not None or not self._thread.is_alive():
                raise WeightSyncError(f"weight broadcast failed: {self._error}")
            time.sleep(0.001)
        self._jobs.put((version, buckets))
        return self.address

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)


class DistReceiverTransport:
    name = "torch_dist"

    def __init__(self, address: str, rank: int, world_size: int, *, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 300.0) -> None:
        if rank < 1:
            raise ValueError("receivers take ranks 1..world_size-1; rank 0 is the sender")
        self.device = device
        self._pg = _group(address, rank, world_size, backend, timeout_s)

    def fetch(self, ann: WeightsAvailable, have_version: int) -> Iterator[tuple[int, str, int, Any]]:
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        _broadcast(self._pg, header)
        version, n = (int(x) for x in header.tolist())
        if version != ann.version or n != len(ann.bucket_sizes):
            raise WeightSyncError(f"broadcast carries version {version} ({n} buckets) but the announcement is "
                                  f"version {ann.version} ({len(ann.bucket_sizes)} buckets): receivers must take "
                                  "every version, in order, on a collective transport")
        for i, size in enumerate(ann.bucket_sizes):
            t = torch.empty(size, dtype=torch.uint8, device=self.device)
            _broadcast(self._pg, t)
            yield i, "dense", -1, (t.cpu().numpy() if t.device.type != "cpu" else t.numpy())

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        pass

    def close(self) -> None:
        pass


__all__ = ["DistReceiverTransport", "DistSenderTransport"]
