"""`WeightReceiver`: the generator side. Fetches an announced version, reconstructs delta buckets,
verifies every bucket's size and checksum, and only then hands ``(name, tensor)`` pairs to `apply` (the
shape vLLM's ``load_weights`` takes) or loads them into a module. A bad transfer raises
`WeightSyncError`, tells the sender, and leaves the previous version in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tidal.core.arrays import ITEMSIZE
from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync import delta
from tidal.weight_sync.buckets import checksum, checksum_tensor, copy_and_checksum, unpack
from tidal.weight_sync.errors import WeightFetchCancelled, WeightSyncError
from tidal.weight_sync.transport_base import ReceiverTransport
from tidal.weight_sync.transports import receiver_transport

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightReceiver:
    def __init__(self, transport: str | Any = "zmq", *, keep_for_delta: bool = True, **transport_options: Any) -> None:
        if isinstance(transport, str):
            transport = receiver_transport(transport, **transport_options)
        if not isinstance(transport, ReceiverTransport):
            raise TypeError(f"a weight transport object must subclass tidal.weight_sync.ReceiverTransport; got "
                            f"{type(transport).__name__}")
        self.transport: ReceiverTransport = transport
        self.keep_for_delta = keep_for_delta
        self.version = -1
        # a bucket is host memory (numpy), or a torch tensor on a GPU (cuda_ipc)
        self._buckets: list[Any] = []  # the held version's bytes (delta base)
        self._spare: list[Any] = []  # the previous set, reused for the next version
        self.last_error = ""

    def receive(self, ann: WeightsAvailable, apply: Callable[[NamedTensors], Any]) -> int:
        """Fetch, verify and apply `ann`; returns the version now held. Older announcements are ignored.
        The tensors given to `apply` view the receiver's buffers, or with `shm` the sender's shared
        memory, mapped read-only: copy them (as `load_into` and vLLM's load_weights do) before
        returning, and never write to them; they are overwritten by a later version."""
        if ann.version <= self.version:
            return self.version
        if ann.transport != self.transport.name:
            raise WeightSyncError(f"version {ann.version} was published over {ann.transport!r} but this receiver "
                                  f"uses {self.transport.name!r}; create WeightReceiver({ann.transport!r})")
        zero_copy = self.transport.zero_copy
        try:
            try:
                buckets, views = self._fetch_and_verify(ann, zero_copy)
            except WeightFetchCancelled as e:  # asked for: no sender to tell (it may be gone)
                self.last_error = str(e)
                raise
            except WeightSyncError as e:
                self.last_error = str(e)
                self.transport.report(ann, ok=False, detail=str(e))
                raise
            apply([named for per_bucket in views for named in per_bucket])
        finally:
            if zero_copy:  # the transport's memory, leased from fetch until now
                self.transport.release(ann)
        self.version = ann.version
        if not zero_copy:  # leased bytes go back to the transport: not kept (no delta base, no spare)
            if self.keep_for_delta:  # the delta base; the older set's memory is reused next time
                self._spare, self._buckets = self._buckets, buckets
            else:  # one set only, reused next time; the sender is asked for dense buckets
                self._spare, self._buckets = buckets, []
        self.transport.report(ann, ok=True)
        return self.version

    def _fetch_and_verify(self, ann: WeightsAvailable, zero_copy: bool = False) -> tuple[list[Any], list[NamedTensors]]:
        """The verified buckets, and per bucket the tensors viewing it (made as each bucket is verified,
        while the transport brings in the next one; nothing is applied before every bucket is verified)."""
        n = len(ann.bucket_sizes)
        if len(ann.checksums) != n:
            raise WeightSyncError(f"announcement of version {ann.version} has {len(ann.checksums)} checksums for {n} buckets")
        by_bucket: dict[int, list] = {}
        for spec in ann.manifest:
            by_bucket.setdefault(spec.bucket, []).append(spec)
        dtypes = {i: specs[0].dtype for i, specs in by_bucket.items()}
        out: list[Any] = [None] * n
        views: list[NamedTensors] = [[] for _ in range(n)]
        # buckets are verified as they arrive, while the transport brings in the next ones
        for i, encoding, base, payload in self.transport.fetch(ann, self.version if self._buckets else -1):
            size = ann.bucket_sizes[i]
            if isinstance(payload, torch.Tensor):  # device bytes (cuda_ipc, torch_dist on GPUs): checked there
                out[i] = self._verify_on_device(ann, i, payload, in_place=zero_copy)
                views[i] = unpack(out[i], by_bucket.get(i, []))
                continue
            # write into last-but-one version's memory (already faulted in); fresh memory otherwise
            spare = self._spare[i] if i < len(self._spare) else None
            dest = (None if zero_copy and encoding != "delta" else
                    spare if isinstance(spare, np.ndarray) and spare.size == size else np.empty(size, np.uint8))
            if encoding == "delta":
                if base != self.version or i >= len(self._buckets):
                    raise WeightSyncError(f"bucket {i} of version {ann.version} is a delta against version {base}, "
                                          f"but this receiver holds version {self.version}")
                try:
                    data = delta.apply(payload, self._buckets[i], ITEMSIZE[dtypes.get(i, "uint8")], out=dest)
                except ValueError as e:
                    raise WeightSyncError(f"bucket {i} of version {ann.version}: bad delta: {e}") from None
            else:
                src = np.frombuffer(payload, dtype=np.uint8)
                _check_size(ann, i, src.size)
                # our own copy, verified (the transport's memory may be reused or freed), unless the
                # transport leases it unchanged until `release`. Even zmq's frames, which nothing else
                # writes, are copied: kept two versions long they make the allocator hand out fresh
                # pages for the next frames, and those page faults cost more than this copy (measured)
                if zero_copy:
                    data = src
                else:
                    assert dest is not None  # a buffer of our own unless the fetch is zero-copy
                    data = dest
            try:
                if encoding == "delta" or zero_copy:
                    crc = checksum(data, ann.checksum)
                else:
                    crc = copy_and_checksum(src, data, ann.checksum)  # into `dest`
            except ValueError as e:
                raise WeightSyncError(str(e)) from None
            _check_sum(ann, i, crc)
            out[i] = data
            views[i] = unpack(data, by_bucket.get(i, []))
        missing = [i for i, d in enumerate(out) if d is None]
        if missing:
            raise WeightSyncError(f"buckets {missing[:5]} of version {ann.version} never arrived")
        return out, views

    def _verify_on_device(self, ann: WeightsAvailable, i: int, payload: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """Check a device bucket where it lies; a copy of our own first unless the transport leases it
        to us unchanged until `release` (torch_dist: its receive buffers)."""
        size = ann.bucket_sizes[i]
        _check_size(ann, i, payload.numel())
        if in_place:
            _check_device_sum(ann, i, payload)
            return payload
        device = self.transport.device or payload.device
        spare = self._spare[i] if i < len(self._spare) else None
        if isinstance(spare, torch.Tensor) and spare.numel() == size and spare.device == torch.device(device):
            dest = spare  # last-but-one version's memory
        else:
            dest = torch.empty(size, dtype=torch.uint8, device=device)
        dest.copy_(payload)  # our own copy, verified: the sender rewrites its buffers
        _check_device_sum(ann, i, dest)
        return dest

    def cancel(self) -> None:
        """Give up the fetch in progress (from another thread): `receive` raises `WeightFetchCancelled`
        soon and the version held stays. For a sender that died mid-fetch and was replaced: without this
        the fetch waits out the transport's timeout."""
        self.transport.cancel()

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_size(ann: WeightsAvailable, i: int, got: int) -> None:
    if got != ann.bucket_sizes[i]:
        raise WeightSyncError(f"bucket {i} of version {ann.version} has {got} bytes, "
                              f"expected {ann.bucket_sizes[i]} (partial transfer)")


def _check_device_sum(ann: WeightsAvailable, i: int, payload: torch.Tensor) -> None:
    """Bucket `i`'s checksum computed where it lies (an unknown algorithm is a WeightSyncError)."""
    try:
        crc = checksum_tensor(payload, ann.checksum)
    except ValueError as e:
        raise WeightSyncError(str(e)) from None
    _check_sum(ann, i, crc)


def _check_sum(ann: WeightsAvailable, i: int, crc: int) -> None:
    if crc != ann.checksums[i]:
        raise WeightSyncError(f"bucket {i} of version {ann.version} fails its checksum "
                              f"({crc:#018x} != {ann.checksums[i]:#018x}): corrupted in transfer")


def load_into(module: torch.nn.Module, *, strict: bool = True) -> Callable[[NamedTensors], None]:
    """An `apply` callback that copies received tensors into `module`'s parameters and buffers."""
    def apply(tensors: NamedTensors) -> None:
        state = module.state_dict()
        missing = [n for n, _ in tensors if n not in state]
        if missing and strict:
            raise WeightSyncError(f"received tensors the module does not have: {missing[:5]}")
        with torch.no_grad():
            for name, t in tensors:
                if name in state:
                    state[name].copy_(t)

    return apply
