"""At-least-once delivery with acknowledgements, for producers whose data must not be lost.

A producer pushes messages that carry an ``id`` over PUSH, and listens on a SUB socket for
``Ack`` messages published under the topic ``ack/<name>``. Unacknowledged messages are resent after
`resend_after` seconds; receivers deduplicate by id, so a resend is harmless. At most `window` messages
are unacknowledged at once: when the receiver stops acknowledging (back-pressure), `send` waits.

A `TrajectoryGroup` is one message under one id (the group id) and is acknowledged as one; what the
pusher reports (`on_ack`, `poll`, `rejected`, `acked`) is still per trajectory id, so a producer settles
its samples the same way whether it sent them one by one or as groups (the ack's `refused` names the
members refused one by one, e.g. stale; ``ok=False`` refuses every member).

    pusher = AckedPusher(buffer_ingest, buffer_pub, name="rollout-0")
    pusher.send(trajectory)          # returns once queued; blocks while the window is full
    pusher.flush(timeout=30)         # every message acknowledged (or rejected)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeAlias

from tidal.core.channels import Channel, push, sub
from tidal.core.errors import ChannelTimeout
from tidal.core.protocol import Ack, Trajectory, TrajectoryGroup
from tidal.core.security import Curve

# what carries an id the receiver acknowledges
Acked: TypeAlias = Trajectory | TrajectoryGroup


def ack_topic(name: str) -> str:
    return f"ack/{name}/"


class AckedPusher:
    def __init__(
        self,
        push_endpoint: str,
        ack_endpoint: str,
        name: str,
        *,
        window: int = 1024,
        resend_after: float = 5.0,
        curve_push: Curve | None = None,
        curve_ack: Curve | None = None,
        hwm: int = 1000,
        on_ack: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.name = name
        self.on_ack = on_ack  # called with the ids of every Ack as it is processed (also inside send)
        self.window = window
        self.resend_after = resend_after
        self._push = push(push_endpoint, curve=curve_push, hwm=hwm, linger=0)
        self._acks = sub(ack_endpoint, topics=[ack_topic(name)], curve=curve_ack, hwm=100_000, linger=0)
        self.pending: OrderedDict[str, tuple[Acked, float]] = OrderedDict()  # id -> (message, last sent)
        self.acked = 0  # trajectories (members of groups counted one by one) acknowledged
        self.rejected: dict[str, str] = {}  # trajectory id -> why the receiver refused it (not resent)
        self.resent = 0

    @property
    def acks(self) -> Channel:
        """The channel acknowledgements arrive on: poll it beside others, then call `poll(timeout=0)`."""
        return self._acks

    def send(self, msg: Acked, timeout: float | None = None) -> None:
        """Queue `msg` (a Trajectory or a TrajectoryGroup: what has an `id`). Waits while `window` messages are unacknowledged;
        raises ChannelTimeout if that lasts longer than `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self.pending) >= self.window:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ChannelTimeout(f"{len(self.pending)} messages unacknowledged; receiver applies back-pressure")
            self.poll(timeout=0.05 if left is None else min(0.05, left))
        self._transmit(msg)

    def _transmit(self, msg: Acked) -> None:
        msg_id = msg.id
        try:
            self._push.send(msg, timeout=0)
            sent = time.monotonic()
        except ChannelTimeout:
            sent = 0.0  # the socket is full: resend on the next poll
        self.pending[msg_id] = (msg, sent)
        # kept ordered by last send time, so the overdue ones are always at the front
        self.pending.move_to_end(msg_id, last=sent != 0.0)

    def poll(self, timeout: float = 0.0) -> list[str]:
        """Process acknowledgements that arrived (waiting up to `timeout` for the first) and resend
        overdue messages. Returns the ids acknowledged by this call."""
        done: list[str] = []
        wait = timeout
        while True:
            try:
                _, msg = self._acks.recv(timeout=wait)
            except ChannelTimeout:
                break
            wait = 0.0
            if type(msg) is Ack:
                for i in msg.ids:
                    entry = self.pending.pop(i, None)
                    if entry is None:
                        continue  # a duplicate ack (of a resend)
                    if type(entry[0]) is not TrajectoryGroup:
                        if msg.ok:
                            self.acked += 1
                            done.append(i)
                        else:
                            self.rejected[i] = msg.detail
                        continue
                    for t in entry[0].trajectories:
                        why = msg.refused.get(t.id) if msg.ok else msg.detail
                        if why is None:
                            self.acked += 1
                            done.append(t.id)
                        else:
                            self.rejected[t.id] = why
        self._resend_overdue()
        if done and self.on_ack is not None:
            self.on_ack(done)
        return done

    def _resend_overdue(self) -> None:
        # `pending` is ordered by last send time: only its head can be overdue first (O(1) when none is)
        now = time.monotonic()
        pending = self.pending
        while pending:
            msg_id, (msg, sent) = next(iter(pending.items()))
            if now - sent < self.resend_after:
                return
            try:
                self._push.send(msg, timeout=0)
            except ChannelTimeout:
                return  # still full; try again later
            self.resent += 1
            pending[msg_id] = (msg, now)
            pending.move_to_end(msg_id)

    def flush(self, timeout: float) -> None:
        """Wait until every message is acknowledged or rejected."""
        deadline = time.monotonic() + timeout
        while self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout(f"{len(self.pending)} messages still unacknowledged after {timeout:g} s")
            self.poll(timeout=min(0.1, left))

    def close(self) -> None:
        self._push.close(linger=0)
        self._acks.close(linger=0)

    def __enter__(self) -> AckedPusher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
