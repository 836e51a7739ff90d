"""Shared-memory transport (one host): each bucket of a version is a POSIX shared-memory segment. The
sender packs straight into the segments; receivers verify the bytes where they lie and hand views of
them to `apply`, so an update costs one copy on each side (packing, and the receiver's own load), not
two on the receiving side.

Versions rotate through `keep` slots (version k uses slot k mod keep), so memory is faulted in once,
not every version. A lease keeps verified bytes unchanged until they are applied: a receiver holds a
shared `flock` on each segment from fetch to `release`, and the sender takes an exclusive one before
it writes a slot. A sender that finds a slot still leased (a slow receiver) never waits for it: it
unlinks that segment and packs into a new one, and the receiver finishes on the old pages. A receiver
that finds a slot being rewritten (it is `keep` or more versions behind) is told to take the newest
announcement. Weights on a GPU go through `cuda_ipc` instead (transport_cuda_ipc.py)."""

from __future__ import annotations

import fcntl
import gc
import logging
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
from tidal.weight_sync.transport_base import ReceiverTransport, SenderTransport

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"


class _Segment:
    """One bucket's shared memory on the sender, with the descriptor its lock is taken on."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, nbytes))
        self.lock_fd = os.open(f"{SHM_DIR}/{name}", os.O_RDONLY)
        self.locked = False

    def array(self, nbytes: int) -> np.ndarray:
        """The segment's first `nbytes`, as a uint8 array (a view of the shared memory)."""
        buf = self.shm.buf
        assert buf is not None, "the segment is closed"
        return np.frombuffer(buf, dtype=np.uint8, count=nbytes)

    def try_lock(self) -> bool:
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.locked = True
        return True

    def unlock(self) -> None:
        if self.locked:
            fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
            self.locked = False

    def discard(self, graveyard: list[shared_memory.SharedMemory]) -> None:
        """Unlink the name (a receiver still reading keeps its pages) and let go of the mapping."""
        self.unlock()
        os.close(self.lock_fd)
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass
        try:
            self.shm.close()
        except BufferError:  # a view of it is still alive in this process: closed at close()
            graveyard.append(self.shm)


class ShmSenderTransport(SenderTransport):
    name = "shm"

    def __init__(self, *, keep: int = 2, prefix: str | None = None) -> None:
        self.keep = max(2, keep)
        self.prefix = prefix or f"tidal-{secrets.token_hex(4)}"
        self._slots: list[dict[int, _Segment]] = [{} for _ in range(self.keep)]
        self._graveyard: list[shared_memory.SharedMemory] = []
        self._staged = 0
        self.replaced = 0  # segments recreated because a receiver still leased them (diagnostics)

    def _claim(self, slot: int, index: int, nbytes: int) -> _Segment:
        """The segment for bucket `index` of `slot`, big enough and locked for writing by this sender."""
        segs, need = self._slots[slot], max(1, nbytes)
        seg = segs.get(index)
        if seg is not None and (seg.shm.size < need or not (seg.locked or seg.try_lock())):
            if seg.shm.size >= need:  # big enough, but a receiver still leases it
                self.replaced += 1
                log.info("shared memory %s is still read by a receiver: packing into a new segment", seg.shm.name)
            seg.discard(self._graveyard)
            seg = None
        if seg is None:
            seg = segs[index] = _Segment(f"{self.prefix}-s{slot}-b{index}", nbytes)
            seg.try_lock()  # new: nobody else has it
        return seg

    def allocator(self):
        """Where the sender should pack the next version: straight into its shared-memory slot."""
        slot = self._staged % self.keep

        def alloc(index: int, nbytes: int) -> np.ndarray:
            return self._claim(slot, index, nbytes).array(nbytes)

        return alloc

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        slot = self._staged % self.keep
        self._staged += 1
        try:
            for b in buckets:
                dest = self._claim(slot, b.index, b.nbytes).array(b.nbytes)
                assert b.data is not None, "stage() takes sealed buckets"
                if not np.shares_memory(dest, b.data):  # packed elsewhere (no allocator used): copy in
                    dest[:] = b.data
        finally:
            self._unlock(slot)  # written: receivers may lease it
        return f"{self.prefix}-s{slot}"

    def abort(self, version: int) -> None:
        self._unlock(self._staged % self.keep)

    def _unlock(self, slot: int) -> None:
        for seg in self._slots[slot].values():
            seg.unlock()

    def close(self) -> None:
        gc.collect()  # numpy views of the segments must go before the mappings can close
        for segs in self._slots:
            for seg in segs.values():
                seg.discard(self._graveyard)
            segs.clear()
        for shm in self._graveyard:
            try:
                shm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with the process
        self._graveyard.clear()


class ShmReceiverTransport(ReceiverTransport):
    name = "shm"
    zero_copy = True  # fetched bytes stay unchanged until `release`: verified and applied in place

    def __init__(self, **_: Any) -> None:
        # name -> (inode, size, fd, mapping): slots are rewritten in place, so a mapping stays valid (and
        # its pages stay faulted in) until the sender recreates the segment, which changes the inode.
        self._maps: dict[str, tuple[int, int, int, mmap.mmap]] = {}
        self._leased: list[int] = []  # descriptors holding a shared lock until `release`

    def fetch(self, ann: WeightsAvailable, have_version: int) -> Iterator[tuple[int, str, int, Any]]:
        self.release(ann)  # a fetch abandoned midway (an error) must not keep its leases
        for i, size in enumerate(ann.bucket_sizes):
            name = f"{ann.location}-b{i}"
            if size == 0:
                yield i, "dense", -1, np.empty(0, np.uint8)
                continue
            fd, m = self._map(name, size, ann.version)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise WeightSyncError(f"shared memory {name} of version {ann.version} is being overwritten by a newer "
                                      "version (this receiver fell behind); take the newest announcement") from None
            self._leased.append(fd)
            yield i, "dense", -1, np.frombuffer(m, dtype=np.uint8, count=size)

    def _map(self, name: str, size: int, version: int) -> tuple[int, mmap.mmap]:
        # Mapped directly rather than through SharedMemory: on Python < 3.13 attaching registers the
        # segment with this process's resource tracker, which would unlink the sender's memory.
        path = f"{SHM_DIR}/{name}"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise WeightSyncError(f"shared memory {name} of version {version} is gone (sender closed?)") from None
        if st.st_size < size:
            raise WeightSyncError(f"shared memory {name} holds fewer than {size} bytes (partial transfer)")
        cached = self._maps.get(name)
        if cached is not None and cached[0] == st.st_ino and cached[1] == size:
            return cached[2], cached[3]
        if cached is not None:
            self._forget(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise WeightSyncError(f"shared memory {name} of version {version} is gone (sender closed?)") from None
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        self._maps[name] = (os.fstat(fd).st_ino, size, fd, m)
        return fd, m

    def _forget(self, name: str) -> None:
        _, _, fd, m = self._maps.pop(name)
        try:
            m.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes when it does
        os.close(fd)

    def release(self, ann: WeightsAvailable) -> None:
        """The bytes of `ann` are applied (or abandoned): the sender may write over them again."""
        self._unlock_leased()

    def _unlock_leased(self) -> None:
        for fd in self._leased:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
        self._leased.clear()

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        pass

    def close(self) -> None:
        gc.collect()
        self._unlock_leased()
        for name in list(self._maps):
            self._forget(name)
