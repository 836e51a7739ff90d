"""The learner's side of the buffer: request a batch share, acknowledge it once trained.

Contract: a rank may hold several batches unacknowledged (a learner acknowledges what it trained once
a checkpoint records it); each request names the newest one held, and the buffer serves the share after
it. A client that holds none (a new one: the rank restarted) is served the oldest unacknowledged share
again, under the same id. Requests and acks are retried across buffer restarts. Batches already
acknowledged by this client are acknowledged again and skipped if they are ever served again, and a
duplicate reply of a batch held is dropped, so nothing is trained twice; across a learner restart, keep
the trained batch ids in the checkpoint and pass them as `trained`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from tidal.core.channels import dealer, make_hello
from tidal.core.errors import ChannelTimeout, ProtocolError
from tidal.core.protocol import ACK_BATCH, Ack, Batch, BatchRequest, Control, Error, Metrics
from tidal.core.security import Curve

# The largest Batch share a learner rank takes (ZeroMQ drops a larger frame unread): generous, finite. A
# share of 256 samples of 32k tokens, ids + logprobs + versions + kv_versions (16 bytes a token), is about
# 130 MiB; MoE routing or sampling masks can add several times that.
MAX_BATCH_BYTES = 4 * 1024**3

log = logging.getLogger("tidal.buffer.client")


class BatchClient:
    def __init__(
        self,
        endpoint: str,
        rank: int = 0,
        world_size: int = 1,
        *,
        name: str | None = None,
        curve: Curve | None = None,
        retry_every: float = 2.0,
        trained: Iterable[str] = (),
        max_batch_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.retry_every = retry_every
        self.name = name or f"learner-{rank}"
        self._ch = dealer(endpoint, curve=curve, linger=0, identity=f"{self.name}-{time.monotonic_ns()}".encode(),
                          max_bytes=max_batch_bytes)
        self.trained: set[str] = set(trained)  # acknowledged batch ids (or trained, per the checkpoint)
        self.held: list[str] = []
        self.protocol_errors: dict[str, int] = {}  # bad replies dropped, by ProtocolError.reason  # batches returned by next_batch and not yet acknowledged, oldest first

    def handshake(self, timeout: float = 10.0) -> None:
        self._ch.handshake(make_hello("learner", self.name), timeout)

    def next_batch(self, version: int, timeout: float = 60.0, ack: str | list[str] | None = None) -> Batch:
        """The next share for this rank (waits while the buffer has too little data). `ack` names
        batches trained (and checkpointed), acknowledged in the same message (one round trip per step
        instead of two; unconfirmed: one the buffer serves again is acknowledged again and skipped);
        batches returned and not acknowledged stay held (see `ack`)."""
        deadline = time.monotonic() + timeout
        acked = [ack] if isinstance(ack, str) else list(ack or [])
        if acked:
            self._settle(acked)
        req = BatchRequest(rank=self.rank, world_size=self.world_size, version=version,
                           acked=acked, after=self.held[-1] if self.held else "")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout(f"no batch from the buffer within {timeout:g} s")
            self._ch.send(req, timeout=left)
            reply = self._wait((Batch, Error), min(self.retry_every, left))
            if reply is None:
                continue  # buffer busy, empty, or restarting: ask again
            if type(reply) is Error:
                raise ProtocolError(f"buffer refused the batch request: {reply.detail}")
            if reply.batch_id in self.trained:
                self.ack(reply.batch_id, timeout=max(left, 1.0))  # served again after a lost ack
                continue
            if reply.batch_id in self.held:
                continue  # a second reply to a request sent again (a retry): this batch is held already
            self.held.append(reply.batch_id)
            return reply

    def ack(self, batch_ids: str | list[str], timeout: float = 60.0) -> None:
        """Acknowledge trained batches (the buffer forgets them); retried until the buffer confirms."""
        ids = [batch_ids] if isinstance(batch_ids, str) else list(batch_ids)
        if not ids:
            return
        self._settle(ids)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout(f"buffer did not confirm the ack of {', '.join(ids[:3])} within {timeout:g} s")
            self._ch.send(Ack(kind=ACK_BATCH, ids=ids), timeout=left)
            reply = self._wait((Ack,), min(self.retry_every, left))
            if reply is not None and set(ids) <= set(reply.ids):
                return

    def _settle(self, ids: list[str]) -> None:
        self.trained.update(ids)
        if self.held:
            done = set(ids)
            self.held = [b for b in self.held if b not in done]

    def status(self, timeout: float = 10.0) -> Metrics:
        self._ch.send(Control(command="status"), timeout=timeout)
        reply = self._wait((Metrics,), timeout)
        if reply is None:
            raise ChannelTimeout(f"no status from the buffer within {timeout:g} s")
        return reply

    def _wait(self, types: tuple[type, ...], timeout: float):
        """The next reply of one of `types`; stale replies of other kinds are discarded."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                msg = self._ch.recv(timeout=left)
            except ChannelTimeout:
                return None
            except ProtocolError as e:  # a reply no decoder accepts (of any kind): dropped, counted; the request is retried
                self.protocol_errors[e.reason] = self.protocol_errors.get(e.reason, 0) + 1
                log.warning("%s: dropped a bad reply from the buffer: %s", self.name, e)
                continue
            if isinstance(msg, types):
                return msg

    def close(self) -> None:
        self._ch.close(linger=0)

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
