"""The ZeroMQ weight transport's sockets take what a transfer needs and no more: the sender's ROUTER takes
requests (small), a receiver's DEALER takes replies as large as the largest announced bucket."""

from __future__ import annotations

import zmq

from tidal.core.codec import PREAMBLE_BYTES
from tidal.core.protocol import WeightsAvailable
from tidal.weight_sync.transport_zmq import (
    BUCKET_SLACK_BYTES,
    REQUEST_MAX_BYTES,
    ZmqReceiverTransport,
    ZmqSenderTransport,
    _reply_bytes,
)


def test_the_weight_sockets_are_sized_from_requests_and_the_announced_buckets():
    sender = ZmqSenderTransport()
    receiver = ZmqReceiverTransport(timeout=1.0)
    try:
        small = WeightsAvailable(version=1, transport="zmq", location=sender.endpoint, manifest=[],
                                 bucket_sizes=[1000, 4000])
        ch = receiver._channel(small.location, _reply_bytes(small))
        assert ch.socket.getsockopt(zmq.MAXMSGSIZE) == 4000 + BUCKET_SLACK_BYTES + PREAMBLE_BYTES
        bigger = 64 * 1024**2 + BUCKET_SLACK_BYTES  # a later version with larger buckets: the socket is made again
        assert receiver._channel(small.location, bigger).socket.getsockopt(zmq.MAXMSGSIZE) == bigger + PREAMBLE_BYTES
        assert receiver._channel(small.location, 10).socket.getsockopt(zmq.MAXMSGSIZE) == bigger + PREAMBLE_BYTES
        assert REQUEST_MAX_BYTES < bigger
    finally:
        receiver.close()
        sender.close()
