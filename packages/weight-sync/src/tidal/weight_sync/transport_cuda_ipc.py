"""CUDA IPC transport (one host, GPU-resident weights): the sender packs each bucket into GPU memory of
its own and publishes CUDA IPC handles of those buffers; a receiver (another process) maps them, copies
each bucket device-to-device into memory of its own, and checks it there with `mix64-sum` (device.py:
computed on the GPU on both ends; no byte crosses to the host). The received tensors live on the
receiver's GPU.

The handles are a msgspec record (msgpack, base64) in the announcement's `location`, never a pickle.
Like `shm`, the sender rewrites the buffers of `keep` slots in turn (version k uses slot k mod keep):
each buffer is shared once, and a receiver maps it once and reads it again on every later version; a
receiver more than `keep` versions behind reads a rewritten slot and fails the checksum. The sender's
writes are complete before `send()` returns (computing the checksum waits for them). Receivers find
the GPU by its UUID, so their CUDA_VISIBLE_DEVICES may number it differently.

Needs CUDA on both ends, and a receiver in another process than the sender (CUDA cannot open an IPC
handle in the process that made it); PyTorch's allocator must not use expandable segments unless the
kernel has pidfd_open. Not run in CI: tools/gpu/weight_sync_check.sh runs it on a GPU.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from typing import Any

import msgspec
import torch

from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync.buckets import Bucket
from tidal.weight_sync.device import MIX64, reusing_allocator
from tidal.weight_sync.errors import WeightSyncError
from tidal.weight_sync.transport_base import ReceiverTransport, SenderTransport

_PREFIX = "cuda-ipc:"


class IpcBucket(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Where one bucket lies: what `torch.UntypedStorage._share_cuda_()` returns, and the bucket in it."""

    nbytes: int  # bucket size; 0: an empty bucket, nothing shared
    uuid: str = ""  # the GPU's UUID: a receiver maps it to its own device index
    device: int = 0  # the GPU's index in the sender's numbering (used when no UUID is known)
    handle: bytes = b""  # cudaIpcMemHandle of the allocation that holds the storage
    storage_nbytes: int = 0  # size of the shared storage
    storage_offset: int = 0  # byte offset of the storage in that allocation
    offset: int = 0  # byte offset of the bucket in the storage
    ref_counter_handle: bytes = b""  # PyTorch's IPC reference-counter file (keeps the memory alive)
    ref_counter_offset: int = 0  # the counter's slot in that file
    event_handle: bytes = b""  # CUDA IPC event recorded when the buffer was shared
    event_sync_required: bool = False  # whether the receiver must wait on that event


class IpcVersion(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """The side record of one version: its slot and the place of every bucket, in bucket order."""

    slot: int  # which of the sender's `keep` buffer sets holds this version
    buckets: list[IpcBucket] = []  # one per bucket of the announcement


def encode_location(record: IpcVersion) -> str:
    return _PREFIX + base64.b64encode(msgspec.msgpack.encode(record)).decode("ascii")


def decode_location(location: str) -> IpcVersion:
    if not location.startswith(_PREFIX):
        raise WeightSyncError(f"announcement location {location[:40]!r} is not a cuda_ipc record (it starts with {_PREFIX!r})")
    try:
        return msgspec.msgpack.decode(base64.b64decode(location[len(_PREFIX):]), type=IpcVersion)
    except (ValueError, msgspec.DecodeError) as e:
        raise WeightSyncError(f"cuda_ipc record in the announcement is malformed: {e}") from None


def require_cuda(role: str) -> None:
    """Raise, naming what is missing, unless this process can use CUDA."""
    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        raise RuntimeError(
            f"the cuda_ipc weight transport ({role}) needs CUDA, but torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, {built}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
            "run it on a host with an NVIDIA GPU, or use the 'shm' transport for weights in host memory")


def _uuid(index: int) -> str:
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except (AttributeError, RuntimeError):
        return ""


class CudaIpcSenderTransport(SenderTransport):
    name = "cuda_ipc"
    checksum = MIX64  # computed on the GPU

    def __init__(self, *, device: str = "cuda", keep: int = 2) -> None:
        require_cuda("sender")
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"cuda_ipc packs into GPU memory: device must be 'cuda' or 'cuda:N', got {device!r}")
        self.pack_device = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        self.keep = max(2, keep)
        self._slots: list[dict[int, torch.Tensor]] = [{} for _ in range(self.keep)]
        self._shared: dict[tuple[int, int], tuple[int, IpcBucket]] = {}  # (slot, index) -> (data_ptr, record)
        self._staged = 0

    def allocator(self):
        """Where the sender should pack the next version: this slot's GPU buffers."""
        return reusing_allocator(self._slots[self._staged % self.keep], self.pack_device)

    def _record(self, slot: int, b: Bucket) -> IpcBucket:
        if b.nbytes == 0:
            return IpcBucket(nbytes=0)
        data = b.data
        if not isinstance(data, torch.Tensor) or data.device.type != "cuda":
            raise WeightSyncError(f"bucket {b.index} is not in GPU memory: send through WeightSender('cuda_ipc'), "
                                  "which packs into this transport's buffers")
        key = (slot, b.index)
        cached = self._shared.get(key)
        if cached is not None and cached[0] == data.data_ptr() and cached[1].nbytes == b.nbytes:
            return cached[1]  # shared once: the receivers' mappings see this version's bytes
        (device, handle, storage_nbytes, storage_offset, rc_handle, rc_offset,
         event_handle, event_sync) = data.untyped_storage()._share_cuda_()
        rec = IpcBucket(nbytes=b.nbytes, uuid=_uuid(device), device=device, handle=handle,
                        storage_nbytes=storage_nbytes, storage_offset=storage_offset,
                        offset=int(data.storage_offset()) * data.element_size(), ref_counter_handle=rc_handle,
                        ref_counter_offset=rc_offset, event_handle=event_handle or b"",
                        event_sync_required=bool(event_sync))
        self._shared[key] = (data.data_ptr(), rec)
        return rec

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        slot = self._staged % self.keep
        self._staged += 1
        return encode_location(IpcVersion(slot=slot, buckets=[self._record(slot, b) for b in buckets]))

    def close(self) -> None:
        self._shared.clear()
        for bufs in self._slots:
            bufs.clear()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # frees buffers no receiver maps any more


class CudaIpcReceiverTransport(ReceiverTransport):
    name = "cuda_ipc"

    def __init__(self, *, device: str | None = None) -> None:
        require_cuda("receiver")
        self.device = torch.device(device) if device is not None else None  # None: the GPU the bucket is on
        # (handle, storage offset) -> mapped storage: opened once, read again on every later version
        self._maps: dict[tuple[bytes, int], torch.UntypedStorage] = {}
        self._by_uuid: dict[str, int] | None = None

    def _local_index(self, rec: IpcBucket) -> int:
        if self._by_uuid is None:
            self._by_uuid = {u: i for i in range(torch.cuda.device_count()) if (u := _uuid(i))}
        if not rec.uuid:
            return rec.device
        if rec.uuid not in self._by_uuid:
            raise WeightSyncError(f"the weights lie on GPU {rec.uuid}, which this process does not see "
                                  f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                                  "a cuda_ipc receiver must see the sender's GPU")
        return self._by_uuid[rec.uuid]

    def _open(self, rec: IpcBucket) -> torch.Tensor:
        key = (rec.handle, rec.storage_offset)
        storage = self._maps.get(key)
        if storage is None:
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    self._local_index(rec), rec.handle, rec.storage_nbytes, rec.storage_offset,
                    rec.ref_counter_handle, rec.ref_counter_offset, rec.event_handle, rec.event_sync_required)
            except RuntimeError as e:
                raise WeightSyncError(f"cannot open the sender's CUDA IPC handle: {e} (sender gone, or in this "
                                      "same process?)") from None
            self._maps[key] = storage
        if rec.offset + rec.nbytes > storage.nbytes():
            raise WeightSyncError(f"bucket of {rec.nbytes} bytes at {rec.offset} overruns the shared storage "
                                  f"of {storage.nbytes()} bytes (partial transfer)")
        view = torch.empty(0, dtype=torch.uint8, device=storage.device)
        return view.set_(storage, rec.offset, (rec.nbytes,), (1,))

    def fetch(self, ann: WeightsAvailable, have_version: int) -> Iterator[tuple[int, str, int, Any]]:
        record = decode_location(ann.location)
        if len(record.buckets) != len(ann.bucket_sizes):
            raise WeightSyncError(f"cuda_ipc record of version {ann.version} places {len(record.buckets)} buckets, "
                                  f"the announcement has {len(ann.bucket_sizes)}")
        live = {(r.handle, r.storage_offset) for r in record.buckets}
        for key in [k for k in self._maps if k not in live]:  # the sender replaced those buffers
            del self._maps[key]
        for i, rec in enumerate(record.buckets):
            if rec.nbytes == 0:
                yield i, "dense", -1, torch.empty(0, dtype=torch.uint8, device=self.device or "cuda")
                continue
            yield i, "dense", -1, self._open(rec)  # the sender's memory: the receiver copies it out

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        pass

    def close(self) -> None:
        self._maps.clear()
