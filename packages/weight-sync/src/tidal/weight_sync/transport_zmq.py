"""ZeroMQ transport: the sender serves buckets from a ROUTER thread; receivers pull them (zero-copy
frames both ways), each choosing dense or delta by the version it holds. Works across hosts (CURVE).

In a run, `security` (a role's `ChannelSecurity`, as a Struct or its dict) sets CURVE up: the sender
(role "learner") lets in the run's rollout workers and weight relays only; a receiver trusts the public
key of its `server` (the learner, or its node's relay: tidal.weight_sync.relay)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import zmq

from tidal.core.arrays import ITEMSIZE, Array
from tidal.core.channels import DealerChannel, dealer, router
from tidal.core.errors import ChannelTimeout, PeerUnreachable, ProtocolError
from tidal.core.protocol import ACK_WEIGHTS, Ack, Error, WeightsAvailable, WeightsBucket, WeightsRequest
from tidal.core.security import AuthGuard, ChannelSecurity, Curve
from tidal.weight_sync import delta
from tidal.weight_sync.buckets import Bucket
from tidal.weight_sync.errors import WeightFetchCancelled, WeightSenderGone, WeightSyncError
from tidal.weight_sync.transport_base import ReceiverTransport, SenderTransport

log = logging.getLogger(__name__)
# The sender's ROUTER takes WeightsRequests and Acks only: a few hundred bytes each.
REQUEST_MAX_BYTES = 1024**2
# A bucket's reply carries its bytes (a delta payload is never larger than the dense bucket: delta.encode)
# plus a small WeightsBucket header: the receiver's DEALER takes frames up to this much beyond the largest
# announced bucket.
BUCKET_SLACK_BYTES = 1024**2


def _security(security: ChannelSecurity | dict[str, Any]) -> ChannelSecurity:
    return security if isinstance(security, ChannelSecurity) else msgspec.convert(security, ChannelSecurity)


class ZmqSenderTransport(SenderTransport):
    name = "zmq"

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", *, curve: Curve | None = None, keep: int = 2,
                 delta_updates: bool = False, security: ChannelSecurity | None = None) -> None:
        self.auth = AuthGuard()  # clients refused (logged once per address; `auth.refused`)
        if security is not None and curve is None:
            curve = _security(security).server(["rollout", "relay"], self.auth, "weight server")
        self.keep = keep
        self.delta_updates = delta_updates
        self._versions: dict[int, list[Bucket]] = {}
        self._anchor: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.reports: dict[int, list[tuple[bool, str]]] = {}  # version -> (ok, detail) per receiver report
        self.protocol_errors: dict[str, int] = {}  # bad requests dropped, by ProtocolError.reason
        self.bytes_sent = 0  # payload bytes served (dense or delta)
        self.bytes_dense = 0  # what the same requests would have cost dense
        self._ready = threading.Event()
        self._endpoint = endpoint
        self._curve = curve
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="tidal-weight-server", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def stage(self, version: int, buckets: list[Bucket], anchor: bool) -> str:
        with self._lock:
            self._versions[version] = buckets
            if anchor:
                self._anchor.add(version)
            for old in sorted(self._versions)[: -self.keep]:
                del self._versions[old]
        return self.endpoint

    def _serve(self) -> None:
        try:
            ch = router(self._endpoint, curve=self._curve, linger=0, hwm=64, max_bytes=REQUEST_MAX_BYTES)
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self.endpoint = ch.endpoint
        self._ready.set()
        cache: dict[tuple[int, int, int], bytes | None] = {}
        with ch:
            while not self._stop.is_set():
                try:
                    peer, msg = ch.recv(timeout=0.1)
                except ChannelTimeout:
                    continue
                except ProtocolError as e:  # any decode failure comes as this; the server goes on
                    self.protocol_errors[e.reason] = self.protocol_errors.get(e.reason, 0) + 1
                    log.warning("weight server: bad request: %s", e)
                    continue
                if type(msg) is Ack and msg.kind == ACK_WEIGHTS:
                    self.reports.setdefault(msg.version, []).append((msg.ok, msg.detail))
                    continue
                if type(msg) is not WeightsRequest:
                    continue
                try:
                    ch.send(peer, self._reply(msg, cache), timeout=30)
                except (PeerUnreachable, ChannelTimeout) as e:
                    log.info("weight server: receiver went away: %s", e)

    def _reply(self, req: WeightsRequest, cache: dict) -> Any:
        with self._lock:
            buckets = self._versions.get(req.version)
            base = self._versions.get(req.have_version)
            anchor = req.version in self._anchor
        if buckets is None or not 0 <= req.bucket < len(buckets):
            return Error(code="refused", detail=f"version {req.version} bucket {req.bucket} is not held "
                         f"(held: {sorted(self._versions)})")
        b = buckets[req.bucket]
        if self.delta_updates and not anchor and base is not None and req.bucket < len(base):
            key = (req.version, req.bucket, req.have_version)
            if key not in cache:
                old = base[req.bucket]
                same_layout = old.dtype == b.dtype and old.nbytes == b.nbytes
                width = np.dtype(_np_width_type(b.dtype)).itemsize
                cache[key] = delta.encode(b.host(), old.host(), width) if same_layout else None
                for k in [k for k in cache if k[0] < req.version - 1]:
                    del cache[k]
            payload = cache[key]
            if payload is not None:
                self.bytes_sent += len(payload)
                self.bytes_dense += b.nbytes
                return WeightsBucket(version=req.version, bucket=req.bucket, encoding="delta",
                                     base_version=req.have_version,
                                     data=Array.from_buffer(payload, "uint8", (len(payload),), out_of_line=True))
        self.bytes_sent += b.nbytes
        self.bytes_dense += b.nbytes
        return WeightsBucket(version=req.version, bucket=req.bucket,
                             data=Array.from_buffer(b.data, "uint8", (b.nbytes,), out_of_line=True))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.auth.close()


def _np_width_type(dtype: str) -> type:
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[ITEMSIZE[dtype]]


def _reply_bytes(ann: WeightsAvailable) -> int:
    """The largest reply a receiver of `ann` takes: its largest bucket and a WeightsBucket header."""
    return max(ann.bucket_sizes, default=0) + BUCKET_SLACK_BYTES


CANCEL_POLL_S = 0.1  # how soon a fetch sees cancel()


class ZmqReceiverTransport(ReceiverTransport):
    name = "zmq"

    def __init__(self, *, curve: Curve | None = None, timeout: float = 60.0, window: int = 0,
                 security: ChannelSecurity | None = None, server: str = "learner") -> None:
        if security is not None and curve is None:  # `server`: whose key serves the weights (a node's "relay")
            curve = _security(security).client(server)
        self.curve = curve
        self.timeout = timeout
        self.window = window  # requests in flight at once; 0 = every bucket at once
        self._ch: DealerChannel | None = None
        self._endpoint = ""
        self._max_bytes = 0
        self.protocol_errors: dict[str, int] = {}  # bad replies dropped, by ProtocolError.reason
        self._cancel = threading.Event()
        self._monitor: zmq.Socket | None = None  # the channel's disconnect events

    def cancel(self) -> None:
        self._cancel.set()

    def _channel(self, endpoint: str, max_bytes: int) -> DealerChannel:
        """The DEALER to `endpoint`, taking frames of up to `max_bytes` (sized from the announced buckets;
        made again when a later announcement has larger ones)."""
        if self._ch is None or endpoint != self._endpoint or max_bytes > self._max_bytes:
            self._drop_channel()
            self._ch = dealer(endpoint, curve=self.curve, linger=0, hwm=64, max_bytes=max_bytes)
            self._endpoint, self._max_bytes = endpoint, max_bytes
            try:  # the sender's process going away shows as a disconnect: a fetch then ends at once
                self._monitor = self._ch.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            except zmq.ZMQError:
                self._monitor = None
        return self._ch

    def _sender_gone(self) -> bool:
        """A disconnect from the sender since the last call (its process died or closed the socket)."""
        gone = False
        while self._monitor is not None:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            gone = True
        return gone

    def fetch(self, ann: WeightsAvailable, have_version: int) -> Iterator[tuple[int, str, int, Any]]:
        """(bucket, encoding, base_version, payload) as buckets arrive; all requests in flight at once."""
        ch = self._channel(ann.location, _reply_bytes(ann))
        n = len(ann.bucket_sizes)
        window = self.window or n
        requested = 0

        def request_more() -> None:
            nonlocal requested
            while requested < n and requested - len(got) < window:
                ch.send(WeightsRequest(version=ann.version, bucket=requested, have_version=have_version),
                        timeout=self.timeout)
                requested += 1

        got: set[int] = set()
        self._cancel.clear()
        self._sender_gone()  # a disconnect before this fetch (a sender since restarted) is not this fetch's
        request_more()
        quiet_since = time.monotonic()  # the timeout counts from the last bucket that came in
        while len(got) < n:
            try:  # in slices, so that cancel() ends the wait at once
                msg = ch.recv(timeout=CANCEL_POLL_S)
            except ChannelTimeout:
                if self._sender_gone():
                    self._drop_channel()
                    raise WeightSenderGone(f"weight sender at {ann.location} went away after {len(got)} of {n} "
                                           f"buckets of version {ann.version}") from None
                if self._cancel.is_set():
                    self._drop_channel()  # requests still queued for the old sender must not reach a new one
                    raise WeightFetchCancelled(f"fetch of version {ann.version} from {ann.location} cancelled "
                                               f"after {len(got)} of {n} buckets") from None
                if time.monotonic() - quiet_since > self.timeout:
                    self._drop_channel()
                    raise WeightSyncError(f"weight sender at {ann.location} sent {len(got)} of {n} buckets of "
                                          f"version {ann.version} within {self.timeout:g} s") from None
                continue
            except ProtocolError as e:  # any decode failure comes as this: dropped; the real bucket may follow
                self.protocol_errors[e.reason] = self.protocol_errors.get(e.reason, 0) + 1
                log.warning("weight receiver: dropped a bad reply from %s: %s", ann.location, e)
                continue
            quiet_since = time.monotonic()
            if type(msg) is Error:
                self._drop_channel()  # the other requests' answers are not wanted by the next fetch
                raise WeightSyncError(f"weight sender refused: {msg.detail}")
            if type(msg) is WeightsBucket and msg.version == ann.version and msg.bucket not in got:
                got.add(msg.bucket)
                request_more()
                yield msg.bucket, msg.encoding, msg.base_version, msg.data.buffer

    def report(self, ann: WeightsAvailable, ok: bool, detail: str = "") -> None:
        try:
            self._channel(ann.location, _reply_bytes(ann)).send(Ack(kind=ACK_WEIGHTS, ids=[f"v{ann.version}"], ok=ok, detail=detail, version=ann.version), timeout=5)
        except ChannelTimeout:
            pass

    def _drop_channel(self) -> None:
        if self._monitor is not None:
            if self._ch is not None:
                try:
                    self._ch.socket.disable_monitor()
                except zmq.ZMQError:
                    pass
            self._monitor.close(linger=0)
            self._monitor = None
        if self._ch is not None:
            self._ch.close(linger=0)
        self._ch, self._endpoint, self._max_bytes = None, "", 0

    def close(self) -> None:
        self._drop_channel()
