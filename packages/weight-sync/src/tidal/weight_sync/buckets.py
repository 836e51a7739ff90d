"""Packing named tensors into flat, checksummed, dtype-homogeneous byte buckets, and back.

A bucket is a contiguous uint8 buffer holding whole tensors of one dtype back to back (a tensor larger
than the bucket size gets a bucket of its own). Packing one bucket at a time means a sender that
gathers sharded weights one tensor at a time never holds more than the open buckets in flight.
"""

from __future__ import annotations

import bisect
import os
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from tidal.core.protocol import TensorSpec
from tidal.weight_sync.device import MIX64, copy_to_device, mix64

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


def as_bytes(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A flat uint8 view of a contiguous copy of `t` in host memory, or on `device` (no copy when it
    already is one)."""
    t = t.detach()
    target = device or torch.device("cpu")
    if t.device != target:
        t = t.to(target, non_blocking=False)
    return t.contiguous().reshape(-1).view(torch.uint8)


# xxh3 (faster than crc32) over 16 MiB chunks hashed in parallel threads (it releases the GIL),
# combined by hashing the chunk digests. The announcement names the algorithm.
CHECKSUM = "xxh3_64-tree16m"
_CHUNK = 16 * 2**20
_HASH_PIECE = 2**19  # packing hashes what it wrote in pieces this big: they are still in L2 cache
_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="tidal-hash")
    return _pool


def _combine(digests: list[int], n: int) -> int:
    return xxhash.xxh3_64_intdigest(np.asarray(digests, dtype=np.uint64).tobytes() + n.to_bytes(8, "little"))


def _tree_xxh3(buf: np.ndarray | memoryview | bytes) -> int:
    view = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8).data
    n = len(view)
    if n <= _CHUNK:
        return _combine([xxhash.xxh3_64_intdigest(view)], n)
    return _combine(list(_threads().map(xxhash.xxh3_64_intdigest, [view[i : i + _CHUNK] for i in range(0, n, _CHUNK)])), n)


def copy_and_checksum(src: np.ndarray, dest: np.ndarray, algorithm: str = CHECKSUM) -> int:
    """Copy `src` into `dest` and return the checksum of the copy, in one pass (see `pack_host`)."""
    return pack_host([src.reshape(-1)], [0], dest, algorithm)


def _buffer(buf: np.ndarray | memoryview | bytes) -> memoryview | bytes:
    """`buf` as the hashers take it (an array's memory as a memoryview, no copy)."""
    return buf.data if isinstance(buf, np.ndarray) else buf


def checksum(buf: np.ndarray | memoryview | bytes, algorithm: str = CHECKSUM) -> int:
    if algorithm == "xxh3_64-tree16m":
        return _tree_xxh3(buf)
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64_intdigest(_buffer(buf))
    if algorithm == "crc32":
        return zlib.crc32(_buffer(buf)) & 0xFFFFFFFF
    if algorithm == MIX64:  # a device-packed version received into host memory
        arr = buf.reshape(-1).view(np.uint8) if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
        with warnings.catch_warnings():  # read-only memory (shm leases, zmq frames): only read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return mix64(torch.from_numpy(arr) if arr.size else torch.empty(0, dtype=torch.uint8))
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: xxh3_64-tree16m, xxh3_64, crc32, mix64-sum")


def checksum_tensor(buf: torch.Tensor, algorithm: str) -> int:
    """A bucket's checksum where it lies: `mix64-sum` on its device, anything else on a host copy."""
    if algorithm == MIX64:
        return mix64(buf)
    return checksum(buf.cpu().numpy(), algorithm)


Alloc = Callable[[int, int], "np.ndarray | torch.Tensor"]  # (bucket index, nbytes) -> uint8 buffer to pack into


def fresh(index: int, nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def pack_host(parts: list[np.ndarray], offsets: list[int], dest: np.ndarray, algorithm: str = CHECKSUM) -> int:
    """Copy `parts` (uint8, at `offsets`) into `dest` and return the checksum of `dest`: 16 MiB chunk by
    chunk in parallel threads, each chunk hashed (streaming xxh3: the same digest) every ~512 KiB
    written, while those bytes are still in the core's L2 cache (~20 % faster than hashing the chunk
    after it is written, more on a busy machine). memcpy (np.copyto) rather than torch's copy_: its
    intra-op threads crawl on a busy machine."""
    n = dest.size
    if algorithm != "xxh3_64-tree16m" or n <= _CHUNK:
        for off, part in zip(offsets, parts, strict=True):
            np.copyto(dest[off : off + part.size], part)
        return checksum(dest, algorithm)
    written = dest.data  # `dest` as a memoryview, what the hasher takes

    def one(lo: int) -> int:
        hi = min(lo + _CHUNK, n)
        h = xxhash.xxh3_64()
        hashed = lo
        k = max(0, bisect.bisect_right(offsets, lo) - 1)  # the first part that reaches into [lo, hi)
        while k < len(parts) and offsets[k] < hi:
            a, b = max(lo, offsets[k]), min(hi, offsets[k] + parts[k].size)
            if a < b:
                np.copyto(dest[a:b], parts[k][a - offsets[k] : b - offsets[k]])
                if b - hashed >= _HASH_PIECE:
                    h.update(written[hashed:b])
                    hashed = b
            k += 1
        h.update(written[hashed:hi])
        return h.intdigest()

    return _combine(list(_threads().map(one, range(0, n, _CHUNK))), n)


@dataclass
class Bucket:
    index: int
    dtype: str
    specs: list[TensorSpec] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)  # uint8 views, packed on `seal`
    nbytes: int = 0
    data: np.ndarray | torch.Tensor | None = None  # uint8 [nbytes] once sealed (a torch tensor on a device)
    crc: int = 0
    seal_s: float = 0.0  # seconds spent packing and checksumming
    ready: Any = None  # a CUDA event: the parts' producing stream got this far (device packing)

    def seal(self, alloc: Alloc = fresh, algorithm: str = CHECKSUM) -> Bucket:
        """Pack the parts into `alloc`'s buffer and checksum it: host memory (numpy) or device memory
        (a torch tensor, checksummed there with `mix64`; see device.py)."""
        t0 = time.perf_counter()
        buf = alloc(self.index, self.nbytes)
        offsets = [s.offset for s in self.specs]
        if isinstance(buf, torch.Tensor):
            copy_to_device(self.parts, offsets, buf, self.ready)
            self.crc = checksum_tensor(buf, algorithm)
        else:
            self.crc = pack_host([p.numpy() for p in self.parts], offsets, buf, algorithm)
        self.parts = []
        self.data = buf
        self.seal_s = time.perf_counter() - t0
        return self

    def host(self) -> np.ndarray:
        """The sealed bytes in host memory (what the host transports read)."""
        if not isinstance(self.data, np.ndarray):
            raise TypeError(f"bucket {self.index} holds {type(self.data).__name__}, not sealed host bytes: this "
                            "transport reads buckets packed in host memory (pack_device None)")
        return self.data


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 device: torch.device | None = None) -> Iterator[Bucket]:
    """Yield unsealed buckets (specs and byte views of their tensors, nothing copied yet) as they fill,
    grouped by dtype, in a deterministic order. Tensors are brought to host memory, or to `device`."""
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
        raw = as_bytes(tensor, device)
        b = open_by_dtype.get(dt)
        if b is not None and b.nbytes + raw.numel() > bucket_bytes and b.specs:
            yield _mark_ready(open_by_dtype.pop(dt), device)
            b = None
        if b is None:
            b = open_by_dtype[dt] = Bucket(index=index, dtype=dt)
            index += 1
        b.specs.append(TensorSpec(name=name, dtype=dt, shape=tuple(tensor.shape), bucket=b.index,
                                  offset=b.nbytes, nbytes=raw.numel()))
        b.parts.append(raw)
        b.nbytes += raw.numel()
    for b in sorted(open_by_dtype.values(), key=lambda b: b.index):
        yield _mark_ready(b, device)


def _mark_ready(b: Bucket, device: torch.device | None) -> Bucket:
    """Device buckets are packed in another thread, on its stream: record how far this thread's
    stream (which produced the parts) has got, for the packer to wait on."""
    if device is not None and device.type == "cuda":
        b.ready = torch.cuda.Event()
        b.ready.record()
    return b


def make_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, alloc: Alloc = fresh) -> Iterator[Bucket]:
    """Yield sealed buckets as they fill (see `plan_buckets`); `alloc` provides the memory to pack into
    (reusing buffers from an earlier version avoids page faults)."""
    for b in plan_buckets(named, bucket_bytes):
        yield b.seal(alloc)


def unpack(data: np.ndarray | memoryview | torch.Tensor, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Tensors viewing `data` (no copy; `data` must stay alive and unchanged while they are used); on
    `data`'s device when it is a torch tensor."""
    if isinstance(data, torch.Tensor):
        base = data.reshape(-1)
    else:
        buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        with warnings.catch_warnings():  # read-only memory (shm leases): the tensors are only read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            base = torch.from_numpy(buf) if buf.size else torch.empty(0, dtype=torch.uint8)
    fast = _unpack_run(base, specs)
    if fast is not None:
        return fast
    out = []
    for s in specs:
        chunk = base[s.offset : s.offset + s.nbytes]
        t = chunk.view(TORCH_DTYPES[s.dtype]) if s.nbytes else torch.empty(0, dtype=TORCH_DTYPES[s.dtype], device=base.device)
        out.append((s.name, t.reshape(s.shape)))
    return out


def _unpack_run(base: torch.Tensor, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]] | None:
    """`unpack` of a bucket as the sender packs it (one dtype, tensors back to back): one dtype view and
    one `torch.split` make every tensor, instead of a slice and a dtype view per tensor in Python (much
    faster for many small tensors). None when the specs are laid out otherwise (the general path checks them)."""
    if not specs:
        return []
    dt = TORCH_DTYPES.get(specs[0].dtype)
    if dt is None:
        return None
    size, pos = dt.itemsize, specs[0].offset
    counts = []
    for s in specs:
        if s.dtype != specs[0].dtype or s.offset != pos or s.nbytes % size or s.nbytes // size != _numel(s.shape):
            return None
        counts.append(s.nbytes // size)
        pos += s.nbytes
    start = specs[0].offset
    if pos > base.numel() or start % size or (base.storage_offset() + start) % size:
        return None
    typed = base[start:pos].view(dt)
    return [(s.name, part.view(s.shape)) for s, part in zip(specs, torch.split(typed, counts), strict=True)]


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
