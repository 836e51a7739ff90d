"""Packing in one process: buckets larger than a checksum chunk are packed and hashed chunk by chunk
in parallel, with tensors straddling the chunk borders; the device checksum gives the same value as
its definition, on CPU tensors here (the GPU path is the same torch code)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.weight_sync.buckets import _CHUNK, CHECKSUM, checksum, make_buckets, plan_buckets, unpack
from tidal.weight_sync.device import MIX64, mix64
from tidal.weight_sync.sender import packed

_M = (1 << 64) - 1


def _fmix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M
    return x ^ (x >> 31)


def mix64_by_definition(b: bytes) -> int:
    padded = b + bytes(-len(b) % 8)
    acc = 0
    for i in range(len(padded) // 8):
        acc = (acc + _fmix((int.from_bytes(padded[8 * i : 8 * i + 8], "little") + i * 0x9E3779B97F4A7C15) & _M)) & _M
    return _fmix((acc + len(b)) & _M)


def odd_state(total_bytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state, n, i = {}, 0, 0
    while n < total_bytes:
        k = int(torch.randint(1, 3_000_001, (1,), generator=g))  # odd sizes, up to ~12 MiB
        state[f"t{i}"] = torch.randn(k, generator=g)
        n, i = n + 4 * k, i + 1
    state["empty"] = torch.empty(0)
    return state


def test_a_bucket_larger_than_a_chunk_packs_bit_exact_and_checksums_as_a_whole():
    state = odd_state(3 * _CHUNK + 12345)
    (bucket,) = list(make_buckets(state.items(), bucket_bytes=1 << 30))
    assert bucket.nbytes > 3 * _CHUNK
    assert bucket.crc == checksum(bucket.data, CHECKSUM)
    for name, t in unpack(bucket.data, bucket.specs):
        assert torch.equal(t, state[name]), name


def test_the_double_buffered_packer_gives_the_buckets_in_order_and_matches_inline_packing():
    state = odd_state(8 * 2**20)
    inline = list(make_buckets(state.items(), bucket_bytes=2**20))
    piped = list(packed(plan_buckets(state.items(), bucket_bytes=2**20), lambda i, n: np.empty(n, np.uint8)))
    assert [b.index for b in piped] == [b.index for b in inline]
    assert [b.crc for b in piped] == [b.crc for b in inline]
    assert all(b.seal_s > 0 for b in piped if b.nbytes)


def test_an_error_while_planning_stops_the_packer_and_raises():
    state = {k: torch.zeros(1000) for k in "abcd"} | {"e": torch.zeros(3, dtype=torch.complex64)}
    got = []
    with pytest.raises(TypeError, match="complex64 cannot be synced"):
        for b in packed(plan_buckets(state.items(), bucket_bytes=1000), lambda i, n: np.empty(n, np.uint8)):
            got.append(b)
    assert [b.index for b in got] == [0, 1]  # out before the bad tensor was reached; bucket 2 was packing


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 4099])
def test_mix64_matches_its_definition(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert mix64(torch.from_numpy(data)) == mix64_by_definition(data.tobytes())
    # a device-packed bucket received into host memory (numpy, or a read-only buffer) checks the same
    assert checksum(data, MIX64) == checksum(data.tobytes(), MIX64) == mix64_by_definition(data.tobytes())


def test_mix64_notices_any_flipped_byte_and_moved_words():
    data = np.random.default_rng(0).integers(0, 256, 4096 + 5, dtype=np.uint8)
    base = mix64(torch.from_numpy(data))
    for pos in (0, 7, 8, 2048, 4096, 4100):
        bad = data.copy()
        bad[pos] ^= 0x80
        assert mix64(torch.from_numpy(bad)) != base, pos
    swapped = data.copy()
    swapped[:8], swapped[8:16] = data[8:16], data[:8]
    assert mix64(torch.from_numpy(swapped)) != base
    two_top_bits = data.copy()  # the pair a plain weighted sum would miss
    two_top_bits[7] ^= 0x80
    two_top_bits[15] ^= 0x80
    assert mix64(torch.from_numpy(two_top_bits)) != base


def test_a_bucket_sealed_into_a_torch_buffer_is_checksummed_there_with_mix64():
    state = {"a": torch.randn(1001), "b": torch.randn(33, 7), "c": torch.empty(0), "d": torch.randn(5)}
    (plan,) = list(plan_buckets(state.items(), bucket_bytes=1 << 30))
    bucket = plan.seal(lambda i, n: torch.empty(n, dtype=torch.uint8), MIX64)
    assert isinstance(bucket.data, torch.Tensor)
    assert bucket.crc == mix64_by_definition(bucket.data.numpy().tobytes())
    for name, t in unpack(bucket.data.numpy(), bucket.specs):
        assert torch.equal(t, state[name]), name
