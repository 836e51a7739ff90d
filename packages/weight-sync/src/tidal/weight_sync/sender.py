"""`WeightSender`: the trainer side. Packs a state dict (or any iterator of named tensors, e.g. one
that gathers FSDP shards one at a time) into checksummed buckets, stages them on a transport, and
returns the `WeightsAvailable` announcement to broadcast to generators."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync.buckets import CHECKSUM, Alloc, Bucket, plan_buckets
from tidal.weight_sync.transport_base import SenderTransport
from tidal.weight_sync.transports import sender_transport

DEFAULT_BUCKET_BYTES = 512 * 1024**2


_packer: ThreadPoolExecutor | None = None


def packed(plans: Iterable[Bucket], alloc: Alloc, algorithm: str = CHECKSUM) -> Iterator[Bucket]:
    """Seal planned buckets in a worker thread, double-buffered: while bucket k is packed and
    checksummed there (memcpy and xxh3 release the GIL), the caller gathers the tensors of bucket k+1 and
    hands bucket k-1 to the transport. Buckets come out in planning order."""
    global _packer
    if _packer is None:
        _packer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-pack")
    pending: Future | None = None
    try:
        for b in plans:
            fut = _packer.submit(b.seal, alloc, algorithm)
            if pending is not None:
                yield pending.result()
            pending = fut
        if pending is not None:
            yield pending.result()
            pending = None
    finally:
        if pending is not None:  # stopped early (an error): let the worker finish with our buffers first
            pending.exception()


def is_lora(name: str) -> bool:
    """Adapter tensors as PEFT names them (lora_A / lora_B / lora_embedding_*)."""
    return "lora_" in name


class WeightSender:
    def __init__(
        self,
        transport: str | Any = "zmq",
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        delta: bool = False,
        anchor_every: int = 10,
        lora_only: bool = False,
        lora_scale: float = 0.0,
        include: Callable[[str], bool] | None = None,
        **transport_options: Any,
    ) -> None:
        if isinstance(transport, str):
            if transport == "zmq":
                transport_options.setdefault("delta_updates", delta)
            elif delta:
                raise ValueError(f"delta updates need a transport that serves receivers individually (zmq), not {transport!r}")
            transport = sender_transport(transport, **transport_options)
        if not isinstance(transport, SenderTransport):
            raise TypeError(f"a weight transport object must subclass tidal.weight_sync.SenderTransport (what the "
                            f"sender calls, with defaults for the optional parts); got {type(transport).__name__}")
        self.transport: SenderTransport = transport
        self.bucket_bytes = bucket_bytes
        self.delta = delta
        self.anchor_every = max(1, anchor_every)
        self.lora_only = lora_only
        if lora_scale and not lora_only:
            raise ValueError("lora_scale is the scale of LoRA adapters: it needs lora_only=True")
        self.lora_scale = float(lora_scale)  # announced: receivers merge W + lora_scale * B @ A
        self.include = include or (is_lora if lora_only else None)
        self.version = -1
        self.last_stats: dict[str, float] = {}
        # Packing buffers are reused across versions (fresh memory costs page faults, ~10x a copy).
        # Transports hold at most the two newest versions, so three generations never collide.
        self._pools: list[dict[int, np.ndarray]] = [{}, {}, {}]
        self._sends = 0

    def send(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int) -> WeightsAvailable:
        if version <= self.version:
            raise ValueError(f"versions must increase: got {version} after {self.version}")
        items = weights.items() if isinstance(weights, Mapping) else weights
        if self.include is not None:
            items = ((n, t) for n, t in items if self.include(n))
        t0 = time.perf_counter()
        buckets, stage_s = self._pack(items, version)
        buckets.sort(key=lambda b: b.index)
        anchor = version % self.anchor_every == 0 or self.version < 0
        ts = time.perf_counter()
        location = self.transport.stage(version, buckets, anchor)
        stage_s += time.perf_counter() - ts
        ann = WeightsAvailable(
            version=version,
            transport=self.transport.name,
            manifest=[s for b in buckets for s in b.specs],
            bucket_sizes=[b.nbytes for b in buckets],
            checksums=[b.crc for b in buckets],
            checksum=self.transport.checksum,
            base_version=self.version if self.delta and not anchor else -1,
            location=location,
            lora_only=self.lora_only,
            lora_scale=self.lora_scale,
        )
        self.transport.write_manifest(ann)
        self.version = version
        nbytes = sum(b.nbytes for b in buckets)
        # pack_s (packing and checksums, in the worker) and stage_s (handing buckets to the transport)
        # overlap: their sum exceeds send_s by the time saved
        self.last_stats = {"weights/bytes": float(nbytes), "weights/buckets": float(len(buckets)),
                           "weights/pack_s": sum(b.seal_s for b in buckets), "weights/stage_s": stage_s,
                           "weights/send_s": time.perf_counter() - t0}
        return ann

    def _pack(self, items: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[list[Bucket], float]:
        """`items` planned into buckets and sealed (in sealing order), each streamed to a transport that
        starts on a bucket at once; and the seconds spent handing them over. Aborts `version` on the
        transport when anything fails."""
        transport: SenderTransport = self.transport
        own = self._pool_alloc()  # every send takes the next generation of the pool
        alloc = transport.allocator() or own  # pack straight into the transport's memory (shm, cuda_ipc)
        stream = transport.stage_bucket if transport.streams else None  # transports that start on a bucket at once
        plans = plan_buckets(items, self.bucket_bytes, transport.pack_device)
        buckets: list[Bucket] = []
        stage_s = 0.0
        try:
            for b in packed(plans, alloc, transport.checksum):
                if stream is not None:
                    ts = time.perf_counter()
                    stream(version, b)
                    stage_s += time.perf_counter() - ts
                buckets.append(b)
            if self.lora_only and not buckets:
                raise ValueError("lora_only is set but no tensor name contains 'lora_'")
        except BaseException:
            transport.abort(version)
            raise
        return buckets, stage_s

    def _pool_alloc(self) -> Alloc:
        """Packing buffers from this send's generation of the pool (buckets are sealed as they fill, per
        dtype, so out of index order: position i == index i)."""
        pool = self._pools[self._sends % len(self._pools)]
        self._sends += 1

        def alloc(index: int, nbytes: int) -> np.ndarray:
            buf = pool.get(index)
            if buf is None or buf.size != nbytes:
                buf = pool[index] = np.empty(nbytes, dtype=np.uint8)
            return buf

        return alloc

    def reports(self, version: int) -> list[tuple[bool, str]]:
        """What receivers told the sender about `version` (transports with a back channel)."""
        return list(self.transport.reports.get(version, []))

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
