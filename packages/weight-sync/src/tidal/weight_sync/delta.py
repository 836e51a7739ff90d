"""Delta encoding of a bucket against the receiver's copy of the previous version.

After one small optimizer step most elements of a bf16 model are bit-identical to the previous version
(FIELD.md: ~99 %). A delta sends only the changed elements: ``u64 count | int32/int64 indices | values``,
compared as raw integers of the element width, so reconstruction is bit-exact (NaN payloads and signed
zeros included). It is used for a bucket only when smaller than the dense bytes.
"""

from __future__ import annotations

import struct

import numpy as np

WIDTH_TYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_COUNT = struct.Struct("<Q")


def encode(new: np.ndarray, old: np.ndarray, width: int) -> bytes | None:
    """The delta of `new` against `old` (both uint8, same size), or None when dense is smaller."""
    if new.shape != old.shape or new.size % width:
        return None
    a, b = new.view(WIDTH_TYPES[width]), old.view(WIDTH_TYPES[width])
    changed = np.flatnonzero(a != b)
    idx_type = np.int32 if a.size < 2**31 else np.int64
    size = _COUNT.size + changed.size * (np.dtype(idx_type).itemsize + width)
    if size >= new.size:
        return None
    return _COUNT.pack(changed.size) + changed.astype(idx_type).tobytes() + a[changed].tobytes()


def apply(delta: memoryview | bytes, old: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """Reconstruct the new bucket bytes from `old` and a delta into `out` (or a new array); `old` is
    untouched."""
    (count,) = _COUNT.unpack_from(delta, 0)
    if out is None or out.size != old.size:
        out = np.empty_like(old)
    np.copyto(out, old)
    new = out
    view = new.view(WIDTH_TYPES[width])
    idx_type = np.int32 if view.size < 2**31 else np.int64
    isz = np.dtype(idx_type).itemsize
    if len(delta) != _COUNT.size + count * (isz + width):
        raise ValueError(f"delta of {len(delta)} bytes does not hold {count} changes of width {width}")
    idx = np.frombuffer(delta, dtype=idx_type, count=count, offset=_COUNT.size)
    if count and (idx.min() < 0 or idx.max() >= view.size):
        raise ValueError("delta index out of range")
    vals = np.frombuffer(delta, dtype=WIDTH_TYPES[width], count=count, offset=_COUNT.size + count * isz)
    view[idx] = vals
    return new
