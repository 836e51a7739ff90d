"""Test stand-ins for roles that issue 9 builds for real: the controller's side of the rollout worker
protocol (credits in, assignments out, acks, heartbeats and metrics recorded) over a real ROUTER."""

from __future__ import annotations

import threading
from collections import Counter

from tidal.core.channels import router
from tidal.core.errors import ChannelTimeout
from tidal.core.protocol import Ack, Assignment, Control, Heartbeat, Metrics, WorkRequest
from tidal.core.testing import free_endpoint


class Controller:
    """The controller's side of the worker protocol: credits in, assignments out, acks recorded."""

    def __init__(self) -> None:
        self.endpoint = free_endpoint()
        self.ch = router(self.endpoint, linger=0)
        self.queue: list[Assignment] = []
        self.sent: dict[str, Assignment] = {}
        self.acks: dict[str, Ack] = {}
        self.credits: Counter[bytes] = Counter()
        self.heartbeats: list[Heartbeat] = []
        self.metrics: list[Metrics] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                peer, msg = self.ch.recv(timeout=0.05)
            except ChannelTimeout:
                peer, msg = None, None
            with self.lock:
                if isinstance(msg, WorkRequest):
                    self.credits[peer] += msg.want
                elif isinstance(msg, Ack) and msg.kind == "assignment":
                    for gid in msg.ids:
                        self.acks[gid] = msg
                elif isinstance(msg, Heartbeat):
                    self.heartbeats.append(msg)
                elif isinstance(msg, Metrics):
                    self.metrics.append(msg)
                for p in list(self.credits):
                    while self.credits[p] > 0 and self.queue:
                        a = self.queue.pop(0)
                        self.sent[a.group_id] = a
                        self.ch.send(p, a, timeout=5)
                        self.credits[p] -= 1

    def assign(self, *assignments: Assignment) -> None:
        with self.lock:
            self.queue.extend(assignments)

    def requeue_unacked(self) -> list[str]:
        """After a worker died: its groups that were never reported done go out again."""
        with self.lock:
            again = [a for gid, a in self.sent.items() if gid not in self.acks]
            self.queue[:0] = again
            self.credits.clear()
            return [a.group_id for a in again]

    def stop_workers(self) -> None:
        with self.lock:
            for peer in list(self.ch.peers):
                self.ch.send(peer, Control(command="stop", reason="test over"), timeout=5)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.ch.close()
