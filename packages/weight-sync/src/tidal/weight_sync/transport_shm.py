"""Shared-memory transport (one host): each bucket of a version is a POSIX shared-memory segment; the
receiver maps it and copies the bytes out once. The sender rewrites the segments of `keep` slots in
turn (version k uses slot k mod keep), so memory is faulted in once, not every version; a receiver more
than `keep` versions behind reads a rewritten slot and fails its checksum rather than reading garbage.
Weights on a GPU go through `cuda_ipc` instead (transport_cuda_ipc.py), without a trip through host memory."""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterator
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

    def _segment(self, slot: int, index: int, nbytes: int) -> shared_memory.SharedMemory:
        segs = self._slots[slot]
        seg = segs.get(index)
        if seg is not None and seg.size < max(1, nbytes):
            seg.close()
            seg.unlink()
            seg = None
        if seg is None:
            seg = segs[index] = shared_memory.SharedMemory(name=f"{self.prefix}-s{slot}-b{index}", create=True,
                                                           size=max(1, nbytes))
        return seg

    def allocator(self):
        """Where the sender should pack the next version: straight into its shared-memory slot."""
        slot = self._staged % self.keep

        def alloc(index: int, nbytes: int) -> np.ndarray:
            return np.frombuffer(self._segment(slot, index, nbytes).buf, dtype=np.uint8, count=nbytes)

        return alloc

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        slot = self._staged % self.keep
        self._staged += 1
        for b in buckets:
            seg = self._segment(slot, b.index, b.nbytes)
            dest = np.frombuffer(seg.buf, dtype=np.uint8, count=b.nbytes)
            if not np.shares_memory(dest, b.data):  # packed elsewhere (no allocator used): copy in
                dest[:] = b.data
        return f"{self.prefix}-s{slot}"

    def close(self) -> None:
        import gc

        gc.collect()  # numpy views of the segments must go before the mappings can close
        for segs in self._slots:
            for seg in segs.values():
                try:
                    seg.close()
                except BufferError:
                    pass  # a caller still holds a view; the mapping goes with the process
                seg.unlink()
            segs.clear()


class ShmReceiverTransport:
    name = "shm"

    def __init__(self, **_: Any) -> None:
        # name -> (inode, size, mapping): slots are rewritten in place, so a mapping stays valid (and
        # its pages stay faulted in) until the sender recreates the segment, which changes the inode.
        self._maps: dict[str, tuple[int, int, mmap.mmap]] = {}

    def fetch(self, ann: WeightsAvailable, have_version: int) -> Iterator[tuple[int, str, int, Any]]:
        for i, size in enumerate(ann.bucket_sizes):
            name = f"{ann.location}-b{i}"
            if size == 0:
                yield i, "dense", -1, np.empty(0, np.uint8)
                continue
            # Mapped directly rather than through SharedMemory: on Python < 3.13 attaching registers the
            # segment with this process's resource tracker, which would unlink the sender's memory.
            try:
                fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
            except FileNotFoundError:
                raise WeightSyncError(f"shared memory {name} of version {ann.version} is gone (sender closed?)") from None
            try:
                st = os.fstat(fd)
                if st.st_size < size:
                    raise WeightSyncError(f"shared memory {name} holds fewer than {size} bytes (partial transfer)")
                cached = self._maps.get(name)
                if cached is not None and cached[0] == st.st_ino and cached[1] == size:
                    m = cached[2]
                else:
                    m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                    self._maps[name] = (st.st_ino, size, m)
            finally:
                os.close(fd)
            yield i, "dense", -1, np.frombuffer(m, dtype=np.uint8, count=size)  # the receiver copies it

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        pass

    def close(self) -> None:
        import gc

        gc.collect()
        for _, _, m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass
        self._maps.clear()
