"""The cuda_ipc transport without a GPU (CI): it refuses to start and says what is missing, its side
record survives the wire, and the registry lists it. Its runs between processes on a GPU are in
test_transports.py (skipped without CUDA; tools/gpu/weight_sync_check.sh runs them)."""

from __future__ import annotations

import pytest
import torch

from tidal.weight_sync import WeightReceiver, WeightSender, WeightSyncError
from tidal.weight_sync.transport_cuda_ipc import IpcBucket, IpcVersion, decode_location, encode_location

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")


@needs_no_cuda
@pytest.mark.parametrize("role", ["sender", "receiver"])
def test_without_cuda_both_ends_refuse_and_say_what_is_missing(role):
    make = WeightSender if role == "sender" else WeightReceiver
    with pytest.raises(RuntimeError, match=rf"cuda_ipc weight transport \({role}\) needs CUDA.*"
                                           r"torch.cuda.is_available\(\) is False.*'shm' transport"):
        make("cuda_ipc")


def test_the_registry_lists_cuda_ipc():
    from tidal.core.plugins import Registry

    assert "cuda_ipc" in Registry().names("weight_transport")


def test_the_handle_record_survives_the_location_string_and_a_bad_one_is_refused():
    rec = IpcVersion(slot=1, buckets=[IpcBucket(nbytes=0), IpcBucket(
        nbytes=4096, uuid="GPU-0b5f", device=0, handle=bytes(range(64)), storage_nbytes=8192, storage_offset=512,
        offset=1024, ref_counter_handle=b"/torch_123_456", ref_counter_offset=7, event_handle=b"\x01" * 64,
        event_sync_required=True)])
    loc = encode_location(rec)
    assert loc.isascii() and decode_location(loc) == rec
    with pytest.raises(WeightSyncError, match="not a cuda_ipc record"):
        decode_location("127.0.0.1:5555#1")
    with pytest.raises(WeightSyncError, match="malformed"):
        decode_location(loc[:-8])
