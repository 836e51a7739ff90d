"""The cuda_ipc transport. Without CUDA (CI): it refuses to start and says what is missing, its side
record survives the wire, and the registry lists it. With CUDA (tools/gpu/weight_sync_check.sh): bit-
identical weights between two processes, and a corrupted GPU bucket rejected with the old version kept."""

from __future__ import annotations

import pytest
import torch

from tidal.weight_sync import WeightReceiver, WeightSender, WeightSyncError
from tidal.weight_sync.transport_cuda_ipc import IpcBucket, IpcVersion, decode_location, encode_location

from .test_transports import assert_bit_identical, make_state, receiver  # noqa: F401 (the fixture)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (tools/gpu/weight_sync_check.sh)")


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


@needs_cuda
@pytest.mark.timeout(300)
def test_cuda_ipc_weights_arrive_bit_identical_on_the_gpu(receiver):  # noqa: F811
    r = receiver("cuda_ipc")
    with WeightSender("cuda_ipc", bucket_bytes=16 * 1024) as sender:
        for version in (1, 2, 5):
            state = {k: v.cuda() for k, v in make_state(version).items()}
            ann = sender.send(state, version)
            assert ann.checksum == "mix64-sum" and len(ann.bucket_sizes) > 10
            assert r.announce(ann)["held"] == version
            assert_bit_identical(r.held(version), {k: v.cpu() for k, v in state.items()})


@needs_cuda
@pytest.mark.timeout(300)
def test_cuda_ipc_corrupted_bucket_is_rejected_and_the_old_version_kept(receiver):  # noqa: F811
    r = receiver("cuda_ipc")
    with WeightSender("cuda_ipc", bucket_bytes=16 * 1024) as sender:
        assert r.announce(sender.send({k: v.cuda() for k, v in make_state(1).items()}, 1))["held"] == 1
        ann = sender.send({k: v.cuda() for k, v in make_state(2).items()}, 2)
        slot = decode_location(ann.location).slot
        sender.transport._slots[slot][3][10] ^= 0xFF  # scribble over a bucket in the sender's GPU memory
        assert r.announce(ann)["held"] == 1
        assert "bucket 3" in r.error(2) and "checksum" in r.error(2)
        fresh = {k: v.cuda() for k, v in make_state(3).items()}
        assert r.announce(sender.send(fresh, 3))["held"] == 3
        assert_bit_identical(r.held(3), {k: v.cpu() for k, v in fresh.items()})
