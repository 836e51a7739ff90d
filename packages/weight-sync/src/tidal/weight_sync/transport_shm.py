"""Shared-memory transport (one host): each bucket of a version is a POSIX shared-memory segment; the
receiver maps it and copies the bytes out once. The sender keeps the last `keep` versions mapped and
unlinks older ones. (CUDA IPC handles for GPU-resident weights are not implemented yet.)"""

from __future__ import annotations

import secrets
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync.buckets import Bucket
from tidal.weight_sync.errors import WeightSyncError


class ShmSenderTransport:
    name = "shm"

    def __init__(self, *, keep: int = 2, prefix: str | None = None) -> None:
        self.keep = keep
        self.prefix = prefix or f"tidal-{secrets.token_hex(4)}"
        self._segments: dict[int, list[shared_memory.SharedMemory]] = {}

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        location = f"{self.prefix}-v{version}"
        segs = []
        for b in buckets:
            seg = shared_memory.SharedMemory(name=f"{location}-b{b.index}", create=True, size=max(1, b.nbytes))
            np.frombuffer(seg.buf, dtype=np.uint8, count=b.nbytes)[:] = b.data
            segs.append(seg)
        self._segments[version] = segs
        for old in sorted(self._segments)[: -self.keep]:
            for seg in self._segments.pop(old):
                seg.close()
                seg.unlink()
        return location

    def close(self) -> None:
        for segs in self._segments.values():
            for seg in segs:
                seg.close()
                seg.unlink()
        self._segments.clear()


class ShmReceiverTransport:
    name = "shm"

    def __init__(self, **_: Any) -> None:
        pass

    def fetch_all(self, ann: WeightsAvailable, have_version: int) -> list[tuple[str, int, Any]]:
        out = []
        for i, size in enumerate(ann.bucket_sizes):
            name = f"{ann.location}-b{i}"
            try:
                seg = shared_memory.SharedMemory(name=name)
            except FileNotFoundError:
                raise WeightSyncError(f"shared memory {name} of version {ann.version} is gone (sender pruned it)") from None
            # Python < 3.13 registers attached segments with this process's resource tracker, which
            # would unlink the sender's segment when we exit: we only borrow it.
            resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
            try:
                out.append(("dense", -1, np.frombuffer(seg.buf, dtype=np.uint8, count=size).copy()))
            finally:
                seg.close()
        return out

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        pass

    def close(self) -> None:
        pass
