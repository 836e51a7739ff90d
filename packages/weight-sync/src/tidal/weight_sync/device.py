"""Buckets in device memory: the `mix64-sum` checksum computed where the bytes are, and packing with device copies.

xxh3 runs on the host only; hashing a GPU bucket with it would cost a copy to the host on both ends.
`mix64-sum` is computed with plain torch integer ops, so it runs on any device and gives the same value
on CPU and GPU: every 8-byte word w_i (the tail zero-padded) is mixed with its index through the
splitmix64 finaliser, h_i = fmix(w_i + i * golden), and the h_i are summed mod 2^64 (integer addition is
associative, so the order of the reduction does not matter); the sum and the length are mixed once more.
Any change to a word changes its h_i pseudo-randomly, so corruption goes unnoticed with probability
about 2^-64. It guards against torn and corrupted transfers, not against an adversary.
"""

from __future__ import annotations

from typing import Any

import torch

MIX64 = "mix64-sum"
_WORDS = 8 * 2**20  # words per step: bounds the temporaries at 64 MiB each
_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _fmix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * _M1  # int64 products wrap mod 2^64, as the unsigned original does
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def mix64(buf: torch.Tensor) -> int:
    """The `mix64-sum` checksum of a flat uint8 tensor, computed on its device."""
    buf = buf.reshape(-1)
    n = buf.numel()
    n8 = n - n % 8
    head = buf[:n8]
    if head.storage_offset() % 8:  # int64 views need 8-byte alignment
        head = head.clone()
    words = head.view(torch.int64) if n8 else torch.empty(0, dtype=torch.int64, device=buf.device)
    m = words.numel()
    acc = torch.zeros((), dtype=torch.int64, device=buf.device)
    for lo in range(0, m, _WORDS):
        w = words[lo : lo + _WORDS]
        idx = torch.arange(lo, lo + w.numel(), dtype=torch.int64, device=buf.device)
        acc += _fmix(w + idx * _GOLDEN).sum()
    if n % 8:  # the tail, zero-padded to a word
        tail = torch.zeros(8, dtype=torch.uint8, device=buf.device)
        tail[: n % 8] = buf[n8:]
        idx = torch.full((1,), m, dtype=torch.int64, device=buf.device)
        acc += _fmix(tail.view(torch.int64) + idx * _GOLDEN).sum()
    return int(_fmix((acc + n).reshape(1)).item()) & _MASK64


def copy_to_device(parts: list[torch.Tensor], offsets: list[int], dest: torch.Tensor, ready: Any = None) -> None:
    """Copy `parts` into the device buffer `dest` at `offsets` (device-to-device, queued on the current
    stream once it has waited for the CUDA event `ready`). The copies are queued, not finished: a checksum
    of `dest` computed next on the same stream (`buckets.checksum_tensor`) reads it back after them."""
    if ready is not None:
        torch.cuda.current_stream(dest.device).wait_event(ready)
    for off, part in zip(offsets, parts, strict=True):
        if part.numel():
            dest[off : off + part.numel()].copy_(part.reshape(-1), non_blocking=True)


def reusing_allocator(buffers: dict[int, torch.Tensor], device: Any):
    """An `Alloc` that packs bucket `index` into `buffers[index]` on `device`, allocating only when the
    bucket is new or changed size (fresh device memory per version would cost an allocation each time)."""

    def alloc(index: int, nbytes: int) -> torch.Tensor:
        buf = buffers.get(index)
        if buf is None or buf.numel() != nbytes:
            buf = buffers[index] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf

    return alloc
