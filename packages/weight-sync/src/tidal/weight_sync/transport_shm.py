"""Shared-memory transport (one host): each bucket of a version is a POSIX shared-memory segment; the
receiver maps it and copies the bytes out once. The sender rewrites the segments of `keep` slots in
turn (version k uses slot k mod keep), so memory is faulted in once, not every version; a receiver more
than `keep` versions behind reads a rewritten slot and fails its checksum rather than reading garbage.
(CUDA IPC handles for GPU-resident weights are not implemented yet.)"""

from __future__ import annotations

import mmap
import os
import secrets
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync.buckets import Bucket
from tidal.weight_sync.errors import WeightSyncError


class ShmSenderTransport:
    name = "shm"

    def __init__(self, *, keep: int = 2, prefix: str | None = None) -> None:
        self.keep = max(2, keep)
        self.prefix = prefix or f"tidal-{secrets.token_hex(4)}"
        self._slots: list[dict[int, shared_memory.SharedMemory]] = [{} for _ in range(self.keep)]
        self._staged = 0

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        slot = self._staged % self.keep
        self._staged += 1
        location = f"{self.prefix}-s{slot}"
        segs = self._slots[slot]
        for b in buckets:
            seg = segs.get(b.index)
            if seg is not None and seg.size < max(1, b.nbytes):
                seg.close()
                seg.unlink()
                seg = None
            if seg is None:
                seg = segs[b.index] = shared_memory.SharedMemory(name=f"{location}-b{b.index}", create=True,
                                                                 size=max(1, b.nbytes))
            np.frombuffer(seg.buf, dtype=np.uint8, count=b.nbytes)[:] = b.data
        return location

    def close(self) -> None:
        for segs in self._slots:
            for seg in segs.values():
                seg.close()
                seg.unlink()
            segs.clear()


class ShmReceiverTransport:
    name = "shm"

    def __init__(self, **_: Any) -> None:
        pass

    def fetch_all(self, ann: WeightsAvailable, have_version: int) -> list[tuple[str, int, Any]]:
        out = []
        for i, size in enumerate(ann.bucket_sizes):
            name = f"{ann.location}-b{i}"
            if size == 0:
                out.append(("dense", -1, np.empty(0, np.uint8)))
                continue
            # Mapped directly rather than through SharedMemory: on Python < 3.13 attaching registers the
            # segment with this process's resource tracker, which would unlink the sender's memory.
            try:
                fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
            except FileNotFoundError:
                raise WeightSyncError(f"shared memory {name} of version {ann.version} is gone (sender closed?)") from None
            try:
                if os.fstat(fd).st_size < size:
                    raise WeightSyncError(f"shared memory {name} holds fewer than {size} bytes (partial transfer)")
                m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            out.append(("dense", -1, np.frombuffer(m, dtype=np.uint8, count=size)))  # the receiver copies it
        return out

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        pass

    def close(self) -> None:
        pass
