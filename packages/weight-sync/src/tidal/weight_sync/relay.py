"""A weight relay: one per generator node, so that each version crosses the network to a node once.

The relay subscribes to the trainer's announcements (`WeightsAvailable` on topic ``weights``), fetches
each new version once over the `zmq` transport (dense), stages it in a zmq weight server of its own and
announces it on its own PUB socket with that server as the location. The node's receivers subscribe to
the relay instead of the trainer and pull from it: dense, or with `delta_updates` the changed elements
against the version they hold. N receivers on a node cost the trainer one copy instead of N.

- Only the newest announcement is fetched (a version announced while an older one is on its way
  replaces it); the latest is published again every `reannounce_s`, for a receiver that subscribed after
  it.
- The relay reports each version it took to the trainer's server (a trainer that waits for one report
  of its final version, as Tidal's learner does, waits for the relay); what the receivers report stays
  with the relay, counted in its log. A fetch that failed is not reported (the trainer would stop
  waiting).
- It holds `keep` versions in host memory: twice the model's bytes by default.
- With `security` (a `ChannelSecurity`, role name ``relay``): CURVE both ways; the relay trusts only the
  key of `upstream_name` for announcements and bytes, and lets in the clients its security lists.
- A version that cannot be fetched (the trainer restarted, a timeout) is logged and taken from the next
  announcement; nothing is announced to the node that the relay does not hold in full.

Run it as a process: ``python -m tidal.weight_sync.relay --config relay.json`` (fields: `RelayConfig`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from tidal.core.channels import pub, sub
from tidal.core.config import ConfigStruct, load_config
from tidal.core.errors import ChannelTimeout, ConfigError, ProtocolError, SecurityError
from tidal.core.net import on_this_node
from tidal.core.process import role_main, setup_role_process
from tidal.core.protocol import TOPIC_WEIGHTS, WeightsAvailable
from tidal.core.security import AuthGuard, ChannelSecurity, owner_only_folder
from tidal.weight_sync.buckets import Bucket
from tidal.weight_sync.errors import WeightSyncError
from tidal.weight_sync.transport_zmq import ZmqReceiverTransport, ZmqSenderTransport

log = logging.getLogger("tidal.weight_sync.relay")


class RelayConfig(ConfigStruct):
    upstream: str = ""  # the trainer's PUB endpoint, where WeightsAvailable is announced
    topic: str = TOPIC_WEIGHTS
    # this relay's weight server (ROUTER; the node's receivers pull here) and PUB (they subscribe here);
    # "{node}" in either is this machine's name in the run (tidal.core.net.on_this_node)
    serve: str = "tcp://127.0.0.1:*"
    publish: str = "tcp://127.0.0.1:*"
    upstream_name: str = "learner"  # the role whose key announces and serves weights upstream
    allow: list[str] = msgspec.field(default_factory=lambda: ["rollout"])  # client names or kinds let in
    security: ChannelSecurity = msgspec.field(default_factory=ChannelSecurity)
    keep: int = 2  # versions held (a receiver fetching the one before the newest can finish)
    delta_updates: bool = False  # serve a receiver that holds the previous version only what changed
    timeout_s: float = 60.0  # a fetch from upstream that gets no bucket for this long fails
    reannounce_s: float = 2.0  # the latest announcement, published again this often (0 = never)


class WeightRelay:
    """Fetch once upstream, serve the node. `step` handles what has arrived; `run` loops until `stop`."""

    def __init__(self, cfg: RelayConfig) -> None:
        if not cfg.upstream:
            raise ConfigError("the relay needs `upstream`: the trainer's PUB endpoint (e.g. tcp://10.0.0.5:5555)",
                              field="upstream")
        cfg = msgspec.structs.replace(cfg, serve=on_this_node(cfg.serve), publish=on_this_node(cfg.publish))
        self.cfg = cfg
        for endpoint in (cfg.serve, cfg.publish):
            _own_folder(endpoint)
        sec = cfg.security
        self.auth = AuthGuard()
        upstream_key = sec.client(cfg.upstream_name)
        self.sub = sub(cfg.upstream, topics=[cfg.topic], linger=0, curve=upstream_key)
        self.receiver = ZmqReceiverTransport(curve=upstream_key, timeout=cfg.timeout_s)
        self.sender = ZmqSenderTransport(cfg.serve, curve=sec.server(cfg.allow, self.auth, "relay weight server"),
                                         keep=cfg.keep, delta_updates=cfg.delta_updates)
        self.pub = pub(cfg.publish, linger=1.0, curve=sec.server(cfg.allow, self.auth, "relay publish"))
        self.endpoint = self.sender.endpoint  # where the node's receivers fetch
        self.version = -1  # the newest version held in full
        self.announced: WeightsAvailable | None = None
        self.fetched_bytes = 0  # bytes taken from upstream (one copy per version)
        self.failures = 0
        self._next_announce = 0.0
        self._lock = threading.Lock()  # the PUB socket: `step` and a caller's `announce_again`

    def step(self, timeout: float = 0.1) -> bool:
        """Take the newest announcement waiting (up to `timeout`), fetch and announce it; True if a new
        version is now held."""
        ann = None
        try:
            ann = self._newest(timeout)
        finally:
            self._announce_again()
        if ann is None or ann.version <= self.version:
            return False
        if ann.transport != "zmq":
            self.failures += 1
            log.error("version %d is announced over %r: the relay fetches over zmq only (set the trainer's "
                      "weights.transport to zmq, or run without a relay)", ann.version, ann.transport)
            return False
        t0 = time.perf_counter()
        try:
            buckets = self._fetch(ann)
        except WeightSyncError as e:  # not reported upstream: a report ends a trainer's wait for its last version
            self.failures += 1
            log.warning("version %d not relayed (taken from the next announcement): %s", ann.version, e)
            return False
        fetch_s = time.perf_counter() - t0
        self.sender.stage(ann.version, buckets, anchor=False)
        self.version = ann.version
        self.announced = msgspec.structs.replace(ann, location=self.endpoint, base_version=-1)
        self._publish(self.announced)
        self.receiver.report(ann, True)
        nbytes = sum(b.nbytes for b in buckets)
        self.fetched_bytes += nbytes
        reports = len(self.sender.reports.get(ann.version - 1, []))
        log.info("relayed version %d: %.1f MiB from %s in %.0f ms (%d receivers took the one before)",
                 ann.version, nbytes / 2**20, ann.location, fetch_s * 1e3, reports)
        return True

    def _newest(self, timeout: float) -> WeightsAvailable | None:
        """The newest announcement waiting (older ones queued behind it are skipped)."""
        newest: WeightsAvailable | None = None
        wait = timeout
        while True:
            try:
                _, msg = self.sub.recv(timeout=wait)
            except ChannelTimeout:
                return newest
            except ProtocolError as e:
                log.warning("dropped a bad announcement: %s", e)
                continue
            if isinstance(msg, WeightsAvailable) and (newest is None or msg.version > newest.version):
                newest = msg
            wait = 0.0

    def _fetch(self, ann: WeightsAvailable) -> list[Bucket]:
        """Every bucket of `ann`, dense, checked for size (the receivers check the checksums)."""
        dtypes = {s.bucket: s.dtype for s in reversed(ann.manifest)}
        data: dict[int, np.ndarray] = {}
        for i, encoding, _, payload in self.receiver.fetch(ann, -1):
            if encoding != "dense":
                raise WeightSyncError(f"bucket {i} of version {ann.version} came {encoding}, asked dense")
            arr = np.frombuffer(payload, np.uint8).copy()  # the frame's memory is the socket's
            if arr.nbytes != ann.bucket_sizes[i]:
                raise WeightSyncError(f"bucket {i} of version {ann.version} has {arr.nbytes} bytes, "
                                      f"announced {ann.bucket_sizes[i]}")
            data[i] = arr
        return [Bucket(index=i, dtype=dtypes.get(i, "uint8"), nbytes=data[i].nbytes, data=data[i],
                       crc=ann.checksums[i] if i < len(ann.checksums) else 0) for i in range(len(ann.bucket_sizes))]

    def _publish(self, ann: WeightsAvailable) -> None:
        with self._lock:
            self.pub.publish(self.cfg.topic, ann)
        self._next_announce = time.monotonic() + self.cfg.reannounce_s

    def _announce_again(self) -> None:
        if self.announced is not None and self.cfg.reannounce_s > 0 and time.monotonic() >= self._next_announce:
            self._publish(self.announced)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.step(0.1)

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()
        self.sub.close()
        self.pub.close()
        self.auth.close()
        for endpoint in {self.cfg.serve, self.cfg.publish}:  # an ipc folder the sockets left empty goes too
            if endpoint.startswith("ipc://"):
                try:
                    Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)
                    Path(endpoint[len("ipc://"):]).parent.rmdir()
                except OSError:
                    pass

    def __enter__(self) -> WeightRelay:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _own_folder(endpoint: str) -> None:
    """An ipc endpoint's folder, made owner-only (0700); one that another user made first is refused (it
    could hold a socket of theirs in our place)."""
    if not endpoint.startswith("ipc://"):
        return
    try:
        owner_only_folder(Path(endpoint[len("ipc://"):]).parent)
    except SecurityError as e:  # a restart would meet it again: refused as configuration
        raise ConfigError(f"the relay's socket {endpoint}: {e}", field="serve") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tidal-weight-relay",
        description="Relay weight versions from a trainer to this node's generators: fetch each version once "
                    "over zmq, serve it to the node.",
        epilog="Overrides use dotted TOML syntax, e.g. upstream=tcp://10.0.0.5:5555 delta_updates=true")
    ap.add_argument("--config", help="TOML or JSON file with RelayConfig fields")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value settings applied on top")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    setup_role_process(args.log_level)
    cfg = load_config(args.config, RelayConfig, args.overrides)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with WeightRelay(cfg) as relay:
        log.info("relay up: serving %s, announcing on %s, from %s", relay.endpoint, cfg.publish, cfg.upstream)
        relay.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(role_main(main, "relay"))
