"""The weight relay (`python -m tidal.weight_sync.relay`, a real process) between a zmq sender with its
PUB and two receivers, CURVE everywhere: every version arrives bit-identical at both receivers while the
sender serves each version once; a receiver that subscribes late gets the latest version re-announced; a
receiver without the node's keys gets nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from tidal.core.channels import pub, sub
from tidal.core.errors import ChannelTimeout
from tidal.core.protocol import TOPIC_WEIGHTS, WeightsAvailable
from tidal.core.security import ChannelSecurity, make_role_keys
from tidal.weight_sync import WeightReceiver, WeightSender

pytestmark = pytest.mark.timeout(180)


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.weight": torch.randn(33, 17 + i, generator=g) for i in range(12)}
    out["lm_head.weight"] = torch.randn(50, 40, generator=g).to(torch.bfloat16)
    return out


def next_announcement(ch, after: int, timeout: float = 30.0) -> WeightsAvailable:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, msg = ch.recv(timeout=0.5)
        except ChannelTimeout:
            continue
        if isinstance(msg, WeightsAvailable) and msg.version > after:
            return msg
    raise AssertionError(f"no announcement past version {after} within {timeout} s")


@pytest.fixture
def keys(tmp_path):
    return make_role_keys(tmp_path / "keys", ["learner", "relay", "rollout-0", "rollout-1", "rollout-9"])


@pytest.fixture
def relay_process(tmp_path, keys):
    """Start the relay as its own process against `upstream`; stopped (SIGTERM) at the end of the test."""
    procs: list[subprocess.Popen] = []

    def start(upstream: str) -> tuple[str, str]:
        sock = tmp_path / "ipc"
        sock.mkdir(mode=0o700)
        serve, publish = f"ipc://{sock}/weights", f"ipc://{sock}/pub"
        sec = ChannelSecurity.from_role_keys(keys, "relay", servers=["learner"], clients=["rollout-0", "rollout-1"])
        cfg = {"upstream": upstream, "serve": serve, "publish": publish, "reannounce_s": 0.5,
               "security": msgspec.to_builtins(sec)}
        (tmp_path / "relay.json").write_text(json.dumps(cfg))
        log = open(tmp_path / "relay.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "tidal.weight_sync.relay", "--config",
                                       str(tmp_path / "relay.json")], stdout=log, stderr=subprocess.STDOUT))
        return serve, publish

    yield start
    for p in procs:
        p.terminate()
        assert p.wait(timeout=30) == 0, (tmp_path / "relay.log").read_text()


def test_two_receivers_behind_a_relay_cost_the_sender_one_copy(tmp_path, keys, relay_process):
    learner = ChannelSecurity.from_role_keys(keys, "learner", clients=["relay"])
    with WeightSender("zmq", bucket_bytes=8 * 1024, security=learner) as sender, \
            pub("tcp://127.0.0.1:*", curve=learner.server(["relay"])) as upstream:
        serve, publish = relay_process(upstream.endpoint)
        workers = [ChannelSecurity.from_role_keys(keys, f"rollout-{i}", servers=["relay"]) for i in range(2)]
        subs = [sub(publish, topics=[TOPIC_WEIGHTS], linger=0, curve=w.client("relay")) for w in workers]
        receivers = [WeightReceiver("zmq", security=w, server="relay") for w in workers]
        try:
            sent = 0
            for version in (1, 2, 3):
                want = state(version)
                ann = sender.send(want, version)
                sent += sum(ann.bucket_sizes)
                assert len(ann.bucket_sizes) > 3
                deadline = time.monotonic() + 60
                got_ann = None
                while got_ann is None:  # the relay may not have subscribed yet: announce until it relays
                    upstream.publish(TOPIC_WEIGHTS, ann)
                    try:
                        got_ann = next_announcement(subs[0], version - 1, timeout=1.0)
                    except AssertionError:
                        assert time.monotonic() < deadline, (tmp_path / "relay.log").read_text()
                assert got_ann.version == version and got_ann.location == serve
                assert got_ann.checksums == ann.checksums and got_ann.manifest == ann.manifest
                for ch, receiver in zip(subs, receivers, strict=True):
                    held: dict[str, torch.Tensor] = {}
                    node_ann = got_ann if ch is subs[0] else next_announcement(ch, version - 1)
                    receiver.receive(node_ann, lambda tensors, held=held: held.update(dict(tensors)))
                    assert set(held) == set(want)
                    for name, t in want.items():
                        assert torch.equal(held[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name
            # one copy per version left the sender; the relay reported each version once
            assert sender.transport.bytes_sent == sent
            assert [len(sender.reports(v)) for v in (1, 2, 3)] == [1, 1, 1]
            assert all(ok for v in (1, 2, 3) for ok, _ in sender.reports(v))

            # a receiver that subscribes now gets version 3, published again by the relay
            late = sub(publish, topics=[TOPIC_WEIGHTS], linger=0, curve=workers[1].client("relay"))
            try:
                assert next_announcement(late, 2, timeout=10).version == 3
            finally:
                late.close()
            # one the relay does not list gets nothing
            stranger = ChannelSecurity.from_role_keys(keys, "rollout-9", servers=["relay"])
            refused = sub(publish, topics=[TOPIC_WEIGHTS], linger=0, curve=stranger.client("relay"))
            try:
                with pytest.raises(AssertionError, match="no announcement"):
                    next_announcement(refused, -1, timeout=2)
            finally:
                refused.close()
        finally:
            for ch in subs:
                ch.close()
            for r in receivers:
                r.close()
    log = (tmp_path / "relay.log").read_text()
    assert "relayed version 3" in log, log


def test_a_relay_without_an_upstream_is_refused_by_name():
    from tidal.core.errors import ConfigError
    from tidal.weight_sync.relay import RelayConfig, WeightRelay

    with pytest.raises(ConfigError, match="the relay needs `upstream`: the trainer's PUB endpoint"):
        WeightRelay(RelayConfig())
