"""Packing named tensors into flat, checksummed, dtype-homogeneous byte buckets, and back.

A bucket is a contiguous uint8 buffer holding whole tensors of one dtype back to back (a tensor larger
than the bucket size gets a bucket of its own). Packing one bucket at a time means a sender that
gathers sharded weights one tensor at a time never holds more than the open buckets in flight.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from tidal.core.protocol import TensorSpec

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}
TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(t: torch.Tensor) -> str:
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"tensors of dtype {t.dtype} cannot be synced; supported: {', '.join(DTYPE_NAMES.values())}") from None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU copy of `t` (no copy when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu", non_blocking=False)
    return t.contiguous().reshape(-1).view(torch.uint8)


# xxh3 (~10 GB/s here, 5x crc32) over 16 MiB chunks hashed in parallel threads (it releases the GIL),
# combined by hashing the chunk digests. The announcement names the algorithm.
CHECKSUM = "xxh3_64-tree16m"
_CHUNK = 16 * 2**20
_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="tidal-hash")
    return _pool


def _combine(digests: list[int], n: int) -> int:
    return xxhash.xxh3_64_intdigest(np.asarray(digests, dtype=np.uint64).tobytes() + n.to_bytes(8, "little"))


def _tree_xxh3(buf: np.ndarray | memoryview | bytes) -> int:
    view = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    n = len(view)
    if n <= _CHUNK:
        return _combine([xxhash.xxh3_64_intdigest(view)], n)
    return _combine(list(_threads().map(xxhash.xxh3_64_intdigest, [view[i : i + _CHUNK] for i in range(0, n, _CHUNK)])), n)


def copy_and_checksum(src: np.ndarray, dest: np.ndarray, algorithm: str = CHECKSUM) -> int:
    """Copy `src` into `dest` and return the checksum of the copy: chunk by chunk, in parallel threads,
    each chunk hashed while it is still in cache (one pass over memory instead of two)."""
    n = src.size
    if algorithm != "xxh3_64-tree16m" or n <= _CHUNK:
        np.copyto(dest, src)
        return checksum(dest, algorithm)

    def one(i: int) -> int:
        np.copyto(dest[i : i + _CHUNK], src[i : i + _CHUNK])
        return xxhash.xxh3_64_intdigest(dest[i : i + _CHUNK])

    return _combine(list(_threads().map(one, range(0, n, _CHUNK))), n)


def checksum(buf: np.ndarray | memoryview | bytes, algorithm: str = CHECKSUM) -> int:
    if algorithm == "xxh3_64-tree16m":
        return _tree_xxh3(buf)
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64_intdigest(buf)
    if algorithm == "crc32":
        return zlib.crc32(buf) & 0xFFFFFFFF
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: xxh3_64-tree16m, xxh3_64, crc32")


Alloc = Callable[[int, int], np.ndarray]  # (bucket index, nbytes) -> uint8 buffer to pack into


def fresh(index: int, nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


@dataclass
class Bucket:
    index: int
    dtype: str
    specs: list[TensorSpec] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)  # uint8 views, packed on `seal`
    nbytes: int = 0
    data: np.ndarray | None = None  # uint8 [nbytes] once sealed
    crc: int = 0

    def seal(self, alloc: Alloc = fresh) -> Bucket:
        buf = alloc(self.index, self.nbytes)
        out = torch.from_numpy(buf) if self.nbytes else torch.empty(0, dtype=torch.uint8)
        for spec, part in zip(self.specs, self.parts, strict=True):
            out[spec.offset : spec.offset + spec.nbytes].copy_(part)
        self.parts = []
        self.data = buf
        self.crc = checksum(self.data)
        return self


def make_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, alloc: Alloc = fresh) -> Iterator[Bucket]:
    """Yield sealed buckets as they fill, grouped by dtype, in a deterministic order. `alloc` provides
    the memory to pack into (reusing buffers from an earlier version avoids page faults)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    open_by_dtype: dict[str, Bucket] = {}
    index = 0
    seen: set[str] = set()
    for name, tensor in named:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one weight update")
        seen.add(name)
        dt = dtype_name(tensor)
        raw = as_bytes(tensor)
        b = open_by_dtype.get(dt)
        if b is not None and b.nbytes + raw.numel() > bucket_bytes and b.specs:
            yield open_by_dtype.pop(dt).seal(alloc)
            b = None
        if b is None:
            b = open_by_dtype[dt] = Bucket(index=index, dtype=dt)
            index += 1
        b.specs.append(TensorSpec(name=name, dtype=dt, shape=tuple(tensor.shape), bucket=b.index,
                                  offset=b.nbytes, nbytes=raw.numel()))
        b.parts.append(raw)
        b.nbytes += raw.numel()
    for b in sorted(open_by_dtype.values(), key=lambda b: b.index):
        yield b.seal(alloc)


def unpack(data: np.ndarray | memoryview, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Tensors viewing `data` (no copy; `data` must stay alive and unchanged while they are used)."""
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    base = torch.from_numpy(buf) if buf.size else torch.empty(0, dtype=torch.uint8)
    out = []
    for s in specs:
        chunk = base[s.offset : s.offset + s.nbytes]
        t = chunk.view(TORCH_DTYPES[s.dtype]) if s.nbytes else torch.empty(0, dtype=TORCH_DTYPES[s.dtype])
        out.append((s.name, t.reshape(s.shape)))
    return out
