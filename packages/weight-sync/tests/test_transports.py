"""Every transport between real processes: bit-identical weights (fp32 and bf16, many tensors, odd
sizes, an empty tensor), increasing versions, corrupted transfers rejected with the old version kept,
delta updates bit-exact over 20 optimizer steps, LoRA-only updates. The cuda_ipc tests need a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tidal.core.channels import push
from tidal.core.protocol import Control
from tidal.core.testing import free_port
from tidal.weight_sync import WeightReceiver, WeightSender
from tidal.weight_sync.transport_cuda_ipc import decode_location

HERE = Path(__file__).parent
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (tools/gpu/weight_sync_check.sh)")


def make_state(seed: int, n: int = 120) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(n):
        shape = (int(torch.randint(1, 70, (1,), generator=g)), int(torch.randint(1, 33, (1,), generator=g)))
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        state[f"layers.{i}.weight"] = torch.randn(shape, generator=g).to(dtype)
    state["empty.bias"] = torch.empty(0)
    state["odd.vector"] = torch.randn(7919, generator=g)  # a prime number of elements
    state["lm_head.weight"] = torch.randn(300, 257, generator=g).to(torch.bfloat16)
    return state


class Receiver:
    def __init__(self, transport: str, out: Path, options: dict | None = None) -> None:
        self.out = out
        self.proc = subprocess.Popen([sys.executable, str(HERE / "recv_process.py"), transport, str(out),
                                      "--options", json.dumps(options or {})],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        endpoint = self.proc.stdout.readline().strip()
        if not endpoint:
            raise RuntimeError(self.proc.stderr.read())
        self.push = push(endpoint, linger=0)

    def announce(self, ann, timeout: float = 60.0) -> dict:
        self.push.send(ann, timeout=10)
        done = self.out / f"v{ann.version}.done"
        deadline = time.monotonic() + timeout
        while not done.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"receiver did not finish version {ann.version}: {self.proc.stderr.read()}")
            time.sleep(0.02)
        return json.loads(done.read_text())

    def held(self, version: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.out / f"v{version}.safetensors"))

    def error(self, version: int) -> str | None:
        p = self.out / f"v{version}.error"
        return p.read_text() if p.exists() else None

    def stop(self) -> None:
        try:
            self.push.send(Control(command="stop"), timeout=5)
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)
        self.push.close()


@pytest.fixture
def receiver(tmp_path):
    made = []

    def make(transport: str, **options) -> Receiver:
        r = Receiver(transport, tmp_path / f"recv-{len(made)}", options)
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


def sender_for(transport: str, tmp_path: Path, **kw) -> WeightSender:
    opts = {"root": str(tmp_path / "weights")} if transport == "fs" else {}
    return WeightSender(transport, bucket_bytes=16 * 1024, **opts, **kw)


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert g.contiguous().view(torch.uint8).numpy().tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes(), name


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["zmq", "shm", "fs"])
def test_weights_arrive_bit_identical_and_versions_increase(transport, receiver, tmp_path):
    r = receiver(transport)
    with sender_for(transport, tmp_path) as sender:
        for version in (1, 2, 5):
            state = make_state(version)
            ann = sender.send(state, version)
            assert len(ann.bucket_sizes) > 10  # small buckets: many of them
            assert r.announce(ann)["held"] == version
            assert_bit_identical(r.held(version), state)
        with pytest.raises(ValueError, match="versions must increase"):
            sender.send(make_state(9), 5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["zmq", "shm", "fs"])
def test_corrupted_transfer_is_rejected_and_the_old_version_kept(transport, receiver, tmp_path):
    r = receiver(transport)
    with sender_for(transport, tmp_path) as sender:
        good = make_state(1)
        assert r.announce(sender.send(good, 1))["held"] == 1
        ann = sender.send(make_state(2), 2)
        if transport == "zmq":  # the bytes are fine but the announcement's checksum is not
            ann = msgspec.structs.replace(ann, checksums=[ann.checksums[0] ^ 1, *ann.checksums[1:]])
        elif transport == "shm":  # scribble over a bucket in shared memory
            seg = shared_memory.SharedMemory(name=f"{ann.location}-b3")
            seg.buf[10] ^= 0xFF
            seg.close()
        else:  # flip a byte of a shard's tensor data
            shard = Path(ann.location) / "bucket-00003.safetensors"
            data = bytearray(shard.read_bytes())
            data[-5] ^= 0xFF
            shard.write_bytes(bytes(data))
        assert r.announce(ann)["held"] == 1  # kept the previous version
        assert "bucket" in r.error(2) and ("checksum" in r.error(2) or "safetensors" in r.error(2))
        if transport == "zmq":
            deadline = time.monotonic() + 10
            while not sender.reports(2) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sender.reports(2) and sender.reports(2)[0][0] is False  # the sender was told
        fresh = make_state(3)
        assert r.announce(sender.send(fresh, 3))["held"] == 3  # and it recovers with the next one
        assert_bit_identical(r.held(3), fresh)


@pytest.mark.timeout(300)
def test_delta_updates_are_bit_exact_over_20_optimizer_steps(receiver, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5)  # small RL-like steps: some bf16 elements change
    r = receiver("zmq")
    with WeightSender("zmq", bucket_bytes=32 * 1024, delta=True, anchor_every=8) as sender:
        for step in range(21):
            if step:
                loss = model(torch.randn(8, 256, dtype=torch.bfloat16)).float().pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            state = {k: v.clone() for k, v in model.state_dict().items()}
            ann = sender.send(state, step)
            assert r.announce(ann)["held"] == step
            assert_bit_identical(r.held(step), state)
        t = sender.transport
        assert t.bytes_sent < t.bytes_dense  # deltas were used and were smaller


@pytest.mark.timeout(120)
def test_lora_only_sends_only_adapters(receiver, tmp_path):
    state = {"q.weight": torch.randn(8, 8), "q.lora_A.weight": torch.randn(2, 8), "q.lora_B.weight": torch.randn(8, 2)}
    r = receiver("zmq")
    with WeightSender("zmq", lora_only=True) as sender:
        ann = sender.send(state, 1)
        assert ann.lora_only and {s.name for s in ann.manifest} == {"q.lora_A.weight", "q.lora_B.weight"}
        r.announce(ann)
        assert set(r.held(1)) == {"q.lora_A.weight", "q.lora_B.weight"}


def test_delta_codec_is_exact_including_nan_payloads_and_signed_zeros():
    from tidal.weight_sync import delta

    old_f = np.zeros(1000, dtype=np.float32)
    old_f[2] = np.nan
    new_f = old_f.copy()
    new_f[0] = -0.0  # equal as floats, different bits
    new_f.view(np.uint32)[2] |= 1  # a different NaN payload
    new_f[3] = 1.5
    old, new = old_f.view(np.uint8), new_f.view(np.uint8)
    enc = delta.encode(new, old, 4)
    assert enc is not None and len(enc) == 8 + 3 * (4 + 4)  # exactly the three changed elements
    assert delta.apply(enc, old, 4).tobytes() == new.tobytes()
    # when most elements change, dense is smaller and no delta is made
    assert delta.encode(np.ones(40, np.uint8), np.zeros(40, np.uint8), 4) is None


def test_transports_are_found_by_name():
    from tidal.core import interfaces
    from tidal.core.plugins import Registry

    reg = Registry()
    assert set(reg.names("weight_transport")) >= {"zmq", "shm", "fs"}
    t = reg.create("weight_transport", "shm")
    assert isinstance(t, interfaces.WeightTransport)
    sender = t.sender({"bucket_bytes": 1 << 20})
    receiver = t.receiver({})
    try:  # the registry hands out the whole sender/receiver, as the core interfaces promise
        assert isinstance(sender, interfaces.WeightSender) and isinstance(receiver, interfaces.WeightReceiver)
        state = make_state(1)
        ann = sender.send(state, 1)
        got: dict = {}
        assert receiver.receive(ann, lambda named: got.update((n, x.clone()) for n, x in named)) == 1
        assert_bit_identical(got, state)
    finally:
        receiver.close()
        sender.close()


@pytest.mark.timeout(180)
def test_torch_distributed_broadcast_to_two_generators(receiver, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    receivers = [receiver("torch_dist", address=address, rank=r, world_size=3, timeout_s=120) for r in (1, 2)]
    with WeightSender("torch_dist", bucket_bytes=16 * 1024, address=address, world_size=3, timeout_s=120) as sender:
        for version in (1, 2):
            state = make_state(version)
            ann = sender.send(state, version)
            for r in receivers:
                r.push.send(ann, timeout=10)
            for r in receivers:
                assert r.announce(ann)["held"] == version  # re-sending the same version is ignored
                assert_bit_identical(r.held(version), state)


def test_receiver_names_a_transport_mismatch(tmp_path):
    from tidal.weight_sync import WeightReceiver, WeightSyncError

    with WeightSender("fs", root=str(tmp_path)) as sender, WeightReceiver("shm") as receiver:
        ann = sender.send({"w": torch.zeros(3)}, 1)
        with pytest.raises(WeightSyncError, match="published over 'fs'.*WeightReceiver\\('fs'\\)"):
            receiver.receive(ann, lambda t: None)
        assert receiver.version == -1


@pytest.mark.timeout(180)
def test_torch_distributed_rejected_version_leaves_the_broadcast_in_step(receiver, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    r = receiver("torch_dist", address=address, rank=1, world_size=2, timeout_s=120)
    with WeightSender("torch_dist", bucket_bytes=16 * 1024, address=address, world_size=2, timeout_s=120) as sender:
        assert r.announce(sender.send(make_state(1), 1))["held"] == 1
        ann = sender.send(make_state(2), 2)
        ann = msgspec.structs.replace(ann, checksums=[ann.checksums[0] ^ 1, *ann.checksums[1:]])
        assert r.announce(ann)["held"] == 1  # rejected at its first bucket; the other buckets still taken
        assert "bucket 0" in r.error(2) and "checksum" in r.error(2)
        fresh = make_state(3)
        assert r.announce(sender.send(fresh, 3))["held"] == 3
        assert_bit_identical(r.held(3), fresh)


@pytest.mark.timeout(180)
def test_torch_distributed_receiver_stays_in_step_past_a_version_given_up_and_one_never_announced(receiver, tmp_path):
    """Buckets are broadcast as they are packed, so a send that fails part way has receivers inside its
    broadcast: it is ended for them, and a receiver that is then announced a later version (the one
    between never reached it) takes that one."""
    address = f"127.0.0.1:{free_port()}"
    r = receiver("torch_dist", address=address, rank=1, world_size=2, timeout_s=120)
    with WeightSender("torch_dist", bucket_bytes=16 * 1024, address=address, world_size=2, timeout_s=120) as sender:
        assert r.announce(sender.send(make_state(1), 1))["held"] == 1

        def gather_fails_part_way():
            yield from list(make_state(2).items())[:60]
            raise RuntimeError("a shard could not be gathered")

        with pytest.raises(RuntimeError, match="could not be gathered"):
            sender.send(gather_fails_part_way(), 2)
        sender.send(make_state(2), 2)  # never announced to the receiver
        fresh = make_state(3)
        ann = sender.send(fresh, 3)
        assert r.announce(ann)["held"] == 3
        assert_bit_identical(r.held(3), fresh)


@pytest.mark.timeout(180)
def test_torch_distributed_device_path_checks_buckets_where_they_arrived(receiver, tmp_path):
    """The path NCCL takes (packing into the transport's own buffers, two sets in turn, mix64-sum, each
    receive buffer checked in place), selected for host tensors over gloo: bit-identical over versions
    that reuse both buffer sets, a corrupted bucket rejected with the old version kept."""
    address = f"127.0.0.1:{free_port()}"
    r = receiver("torch_dist", address=address, rank=1, world_size=2, timeout_s=120, verify_on_device=True)
    with WeightSender("torch_dist", bucket_bytes=16 * 1024, address=address, world_size=2, timeout_s=120,
                      verify_on_device=True) as sender:
        for version in (1, 2, 3):
            state = make_state(version)
            ann = sender.send(state, version)
            assert ann.checksum == "mix64-sum" and len(ann.bucket_sizes) > 10
            assert r.announce(ann)["held"] == version
            assert_bit_identical(r.held(version), state)
        ann = sender.send(make_state(4), 4)
        ann = msgspec.structs.replace(ann, checksums=[*ann.checksums[:2], ann.checksums[2] ^ 1, *ann.checksums[3:]])
        assert r.announce(ann)["held"] == 3
        assert "bucket 2" in r.error(4) and "checksum" in r.error(4)
        fresh = make_state(5)
        assert r.announce(sender.send(fresh, 5))["held"] == 5
        assert_bit_identical(r.held(5), fresh)


@needs_cuda
@pytest.mark.timeout(300)
def test_cuda_ipc_weights_arrive_bit_identical_on_the_gpu(receiver):
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
def test_cuda_ipc_corrupted_bucket_is_rejected_and_the_old_version_kept(receiver):
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


def test_fs_shards_are_safetensors_files_that_load_bit_identical(tmp_path):
    """The fs transport writes packed buckets as they are, behind a safetensors header: safetensors' own
    loader must read every dtype back, an empty tensor included."""
    from tidal.weight_sync import WeightSender

    torch.manual_seed(0)
    state = {"w": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "empty": torch.empty(0),
             "steps": torch.arange(9, dtype=torch.int64), "h": torch.randn(13).half(),
             "flags": torch.tensor([True, False, True])}
    with WeightSender("fs", root=str(tmp_path), bucket_bytes=64) as sender:
        ann = sender.send(state, 1)
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(ann.location).glob("*.safetensors")):
        got.update(load_file(str(shard)))
    assert set(got) == set(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_shm_bytes_leased_to_a_receiver_are_not_written_over():
    """The shm receiver verifies and applies in place; a sender two versions on packs elsewhere."""
    import fcntl

    from tidal.weight_sync import WeightReceiver, WeightSyncError

    with WeightSender("shm", bucket_bytes=16 * 1024) as sender, WeightReceiver("shm") as receiver:
        v1, later = make_state(1), {v: make_state(v) for v in (2, 3)}
        seen: dict[str, torch.Tensor] = {}

        def apply(named):  # runs while version 1 is leased: the sender goes on meanwhile
            for v in (2, 3):  # version 3 reuses version 1's slot
                sender.send(later[v], v)
            seen.update((n, t.clone()) for n, t in named)

        assert receiver.receive(sender.send(v1, 1), apply) == 1
        assert_bit_identical(seen, v1)
        assert sender.transport.replaced > 0  # version 3 went to fresh segments
        # released: version 4 reuses the slot without replacing it again
        replaced = sender.transport.replaced
        ann5 = sender.send(make_state(4), 4) and sender.send(make_state(5), 5)
        assert sender.transport.replaced == replaced
        got: dict = {}
        assert receiver.receive(ann5, lambda named: got.update((n, t.clone()) for n, t in named)) == 5
        assert_bit_identical(got, make_state(5))

        # a slot being written (as the sender holds it while packing) is not read: take a newer version
        ann6 = sender.send(make_state(6), 6)
        fd = os.open(f"/dev/shm/{ann6.location}-b2", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with pytest.raises(WeightSyncError, match="being overwritten by a newer version"):
                receiver.receive(ann6, lambda named: None)
        finally:
            os.close(fd)
        assert receiver.version == 5
        assert receiver.receive(ann6, lambda named: None) == 6  # the leases of the failed try were let go


def test_fs_keeps_the_newest_versions_and_drops_a_stale_newer_run(tmp_path):
    """A folder left by an earlier run with higher versions must not make the sender prune what it just
    wrote: the stale versions go, the new one and its predecessor stay."""
    root = tmp_path / "weights"
    for v in (5, 6):  # an earlier run's versions
        (root / f"v{v:08d}").mkdir(parents=True)
    with WeightSender("fs", root=str(root), keep=2) as sender:
        for v in (1, 2, 3):
            ann = sender.send(make_state(v, n=4), v)
            assert (Path(ann.location) / "manifest.json").is_file()
    assert sorted(p.name for p in root.iterdir()) == ["v00000002", "v00000003"]


def test_a_receiver_that_keeps_no_delta_base_gets_dense_buckets():
    from tidal.weight_sync import WeightReceiver

    torch.manual_seed(0)
    state = {"w": torch.randn(4096), "b": torch.randn(300).to(torch.bfloat16)}
    with WeightSender("zmq", bucket_bytes=4096, delta=True, anchor_every=100) as sender, \
            WeightReceiver("zmq", keep_for_delta=False) as receiver:
        for v in range(3):
            state["w"][v] += 1.0  # one element changes: a delta would be tiny
            got: dict = {}
            assert receiver.receive(sender.send(state, v), lambda named, got=got: got.update((n, t.clone()) for n, t in named)) == v
            assert_bit_identical(got, state)
        assert sender.transport.bytes_sent == sender.transport.bytes_dense  # nothing was sent as a delta


def test_every_transport_implements_the_declared_interface_and_others_are_refused():
    """The sender and receiver call a transport's methods directly (tidal.weight_sync.transport_base): each
    built-in transport subclasses the declared base, and an object that does not is refused by name."""
    import importlib

    from tidal.weight_sync import ReceiverTransport, SenderTransport
    from tidal.weight_sync.transports import TRANSPORTS

    for module, sender, receiver in TRANSPORTS.values():
        mod = importlib.import_module(f"tidal.weight_sync.{module}")
        assert issubclass(getattr(mod, sender), SenderTransport), sender
        assert issubclass(getattr(mod, receiver), ReceiverTransport), receiver

    class Bare:
        name = "bare"

    with pytest.raises(TypeError, match="must subclass tidal.weight_sync.SenderTransport"):
        WeightSender(Bare())
    with pytest.raises(TypeError, match="must subclass tidal.weight_sync.ReceiverTransport"):
        WeightReceiver(Bare())
