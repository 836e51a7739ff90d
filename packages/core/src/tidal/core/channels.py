"""Typed ZeroMQ channels: the socket patterns Tidal's processes talk over.

    push / pull       trajectories from rollout workers into the buffer (fan-in, back-pressure by HWM)
    router / dealer   request/reply with many peers: batches to learner ranks, prompts to workers
    pub / sub         broadcast: metrics, weight announcements, control

Every channel sends and receives `tidal.core.protocol` messages through a `Codec`: large arrays leave
as zero-copy frames, decoding is typed, and a bad message raises `ProtocolError` for that message only;
the channel stays usable. Every receive takes a timeout (seconds). Non-loopback endpoints require CURVE.
Every socket sets ZeroMQ's MAXMSGSIZE from its codec's limits (`max_bytes`, or the codec's own): libzmq
drops a larger frame, and the connection it came on, before buffering it, so a peer claiming an 8 GB
frame costs nothing. Size `max_bytes` to the largest legitimate message the channel receives.

    with pull("tcp://127.0.0.1:*") as inbox, push(inbox.endpoint) as outbox:
        outbox.send(Heartbeat(role="demo", name="a", seq=0, time=0.0))
        print(inbox.recv(timeout=5))
"""

from __future__ import annotations

import os
import socket as _pysocket
import threading
import time
from collections.abc import Iterable
from typing import Any

import zmq

from tidal.core import __version__
from tidal.core.codec import PREAMBLE_BYTES, Codec
from tidal.core.errors import (
    ChannelClosed,
    ChannelTimeout,
    PeerUnreachable,
    ProtocolError,
    ProtocolVersionError,
    TidalError,
)
from tidal.core.protocol import PROTOCOL_VERSION, Error, Hello, Message
from tidal.core.security import Curve, CurveServer, apply_curve, require_curve_if_remote


def _ms(timeout: float | None) -> int:
    return -1 if timeout is None else max(0, int(timeout * 1000))


def max_frame_bytes(codec: Codec) -> int:
    """ZeroMQ's MAXMSGSIZE (checked per frame on receive) for a socket decoding with `codec`: no frame
    of a message the codec would accept is larger (a ROUTER's identity and a SUB's topic are small)."""
    return max(codec.max_header_bytes, codec.max_message_bytes) + PREAMBLE_BYTES


class Channel:
    """One ZeroMQ socket speaking the Tidal protocol. Use the factory functions below."""

    socket_type: int = -1

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool,
        curve: Curve | None = None,
        hwm: int = 1000,
        linger: float = 1.0,
        codec: Codec | None = None,
        context: zmq.Context | None = None,
        identity: bytes | None = None,
        recv_timeout: float | None = None,
        max_bytes: int | None = None,
    ) -> None:
        require_curve_if_remote(endpoint, curve)
        if codec is None:
            codec = Codec() if max_bytes is None else Codec(max_message_bytes=max_bytes, max_header_bytes=max_bytes)
        elif max_bytes is not None:
            raise ValueError("give the channel either max_bytes or a codec (with its own limits), not both")
        self.codec = codec
        self.recv_timeout = recv_timeout
        self._closed = False
        # a CURVE server that checks client keys (ZAP) tells who sent each message it receives
        self._zap = isinstance(curve, CurveServer) and (curve.clients is not None or curve.authorized_keys_dir is not None)
        self.sender: str | None = None  # the last received message's authenticated client key (Z85), with ZAP
        ctx = context or zmq.Context.instance()
        sock = ctx.socket(self.socket_type)
        try:
            sock.sndhwm = hwm
            sock.rcvhwm = hwm
            sock.linger = _ms(linger)
            if identity is not None:
                sock.identity = identity
            sock.maxmsgsize = max_frame_bytes(codec)
            self._configure(sock)
            apply_curve(sock, curve)
            if bind:
                sock.bind(endpoint)
                endpoint = sock.last_endpoint.decode()
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            action = "bind" if bind else "connect"
            raise TidalError(f"cannot {action} {type(self).__name__} to {endpoint}: {e}") from None
        self.socket = sock
        self.endpoint = endpoint  # resolved (a "tcp://127.0.0.1:*" bind gets its real port)

    def _configure(self, sock: zmq.Socket) -> None:
        """Socket options specific to a pattern."""

    # ------------------------------------------------------------------ plumbing

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosed(f"{type(self).__name__} on {self.endpoint} is closed")

    def _wait(self, timeout: float | None, flags: int = zmq.POLLIN) -> None:
        timeout = self.recv_timeout if timeout is None and flags == zmq.POLLIN else timeout
        if timeout is not None and not self.socket.poll(_ms(timeout), flags):
            what = "nothing received" if flags == zmq.POLLIN else "could not send: queue full (peer slow or absent)"
            raise ChannelTimeout(f"{what} on {self.endpoint} within {timeout:g} s")

    # Leading frames received as bytes (envelope and header: small, cheaper copied); the rest,
    # array data, zero-copy. ROUTER and SUB have one envelope frame before the header.
    _copied_frames = 1

    def _recv_frames(self, timeout: float | None, view_at_least: int = 0) -> list[Any]:
        if self._closed:
            self._check_open()
        sock = self.socket
        try:  # a busy stream has a message waiting: skip the poll system call
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._wait(timeout)
            frame = sock.recv(copy=False)
        if self._zap:
            self.sender = frame.get("User-Id")
        # zmq.Frame tells `more` without a getsockopt call; the leading frames are copied out as bytes
        # (a large first frame, when asked, is not: a read-only view that keeps the received message alive)
        frames: list[Any] = [frame.buffer.toreadonly() if view_at_least and len(frame) >= view_at_least else frame.bytes]
        while frame.more:
            frame = sock.recv(copy=False)
            frames.append(frame.bytes if len(frames) < self._copied_frames else frame)
        return frames

    def _send_frames(self, frames: list[Any], timeout: float | None) -> None:
        if self._closed:
            self._check_open()
        if timeout is None:
            self._send_now(frames, 0)
            return
        try:  # room in the queue is the common case: no poll system call
            self._send_now(frames, zmq.NOBLOCK)
        except zmq.Again:
            self._wait(timeout, zmq.POLLOUT)
            try:
                self._send_now(frames, zmq.NOBLOCK)
            except zmq.Again:
                raise ChannelTimeout(f"could not send on {self.endpoint}: queue full (peer slow or absent)") from None

    def _send_now(self, frames: list[Any], flags: int) -> None:
        if len(frames) == 1:
            self.socket.send(frames[0], flags)
        else:
            # a multipart message is queued atomically: EAGAIN can only happen on its first frame
            self.socket.send_multipart(frames, flags, copy=False)

    def close(self, linger: float | None = None) -> None:
        if not self._closed:
            self._closed = True
            self.socket.close(linger=None if linger is None else _ms(linger))

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint!r})"


class PushChannel(Channel):
    socket_type = zmq.PUSH

    def send(self, msg: Message, timeout: float | None = None) -> None:
        """Queue `msg`; blocks while the high-water mark is reached (back-pressure) up to `timeout`."""
        self._send_frames(self.codec.encode(msg), timeout)


class PullChannel(Channel):
    socket_type = zmq.PULL

    def recv(self, timeout: float | None = None) -> Message:
        """Next message. Raises ChannelTimeout, or ProtocolError for a bad one (the next recv works)."""
        return self.codec.decode(self._recv_frames(timeout))

    def recv_frames(self, timeout: float | None = None, *, view_at_least: int = 0) -> list[Any]:
        """Next message's frames, not decoded (for a receiver with a decoder of its own; `codec.decode`
        them for the checked message and its errors). Frame 0 as in `recv_with_frames`."""
        return self._recv_frames(timeout, view_at_least)

    def recv_with_frames(self, timeout: float | None = None, *, view_at_least: int = 0) -> tuple[Message, list[Any]]:
        """Next message and the frames it came in, e.g. to store it without re-encoding. Frame 0 comes as
        bytes, or, when it is at least `view_at_least` (> 0) bytes, as a read-only memoryview of the
        received ZeroMQ message (not copied; the view keeps that message's memory alive)."""
        frames = self._recv_frames(timeout, view_at_least)
        return self.codec.decode(frames), frames


class PubChannel(Channel):
    socket_type = zmq.PUB

    def __init__(self, endpoint: str, *, watch_subscriptions: bool = False, **kw: Any) -> None:
        if watch_subscriptions:  # an XPUB socket: publishes the same, and sees subscriptions arrive
            self.socket_type = zmq.XPUB
        self._prefixes: set[bytes] = set()
        super().__init__(endpoint, **kw)

    def publish(self, topic: str, msg: Message) -> None:
        """Send `msg` to every subscriber of a prefix of `topic`. Never blocks (slow subscribers drop)."""
        self._check_open()
        self.socket.send_multipart([topic.encode(), *self.codec.encode(msg)], copy=False)

    def wait_for_subscriber(self, topic: str, timeout: float) -> bool:
        """Wait until a subscription to exactly `topic` arrives (PUB/SUB drops what is published before
        a subscription arrives). A catch-all or other-topic subscriber does not count: the point is to
        wait for the one consumer that subscribes to `topic`. Needs ``watch_subscriptions=True``. False
        if none arrived within `timeout`."""
        if self.socket_type != zmq.XPUB:
            raise ValueError("wait_for_subscriber needs a channel made with watch_subscriptions=True")
        want = topic.encode()
        deadline = time.monotonic() + timeout
        while want not in self._prefixes:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(_ms(min(left, 0.1))):
                if left <= 0:
                    return False
                continue
            event = self.socket.recv()
            if event[:1] == b"\x01":
                self._prefixes.add(event[1:])
            elif event[:1] == b"\x00":
                self._prefixes.discard(event[1:])
        return True


class SubChannel(Channel):
    socket_type = zmq.SUB
    _copied_frames = 2

    def __init__(self, endpoint: str, *, topics: Iterable[str] = ("",), **kw: Any) -> None:
        self._topics = list(topics)
        super().__init__(endpoint, **kw)

    def _configure(self, sock: zmq.Socket) -> None:
        for t in self._topics:
            sock.setsockopt(zmq.SUBSCRIBE, t.encode())

    def recv(self, timeout: float | None = None) -> tuple[str, Message]:
        frames = self._recv_frames(timeout)
        if len(frames) < 2:
            raise ProtocolError("published message lacks a topic frame")
        topic = bytes(frames[0]).decode("utf-8", "replace")
        return topic, self.codec.decode(frames[1:])


class RouterChannel(Channel):
    """Server side of request/reply with many peers. Answers `Hello` by itself (see `peers`)."""

    socket_type = zmq.ROUTER
    _copied_frames = 2

    def __init__(self, endpoint: str, *, hello: Hello | None = None, reply_errors: bool = True, **kw: Any) -> None:
        kw.setdefault("bind", True)
        super().__init__(endpoint, **kw)
        self.hello = hello or make_hello("server", f"router-{os.getpid()}")
        self.reply_errors = reply_errors
        self.peers: dict[bytes, Hello] = {}  # peer identity -> the Hello it sent

    def _configure(self, sock: zmq.Socket) -> None:
        sock.router_mandatory = True  # sending to a vanished peer raises instead of dropping silently

    def recv(self, timeout: float | None = None) -> tuple[bytes, Message]:
        """Next (peer, message) that is not a handshake. A bad message, or a Hello of another major
        version, raises ProtocolError (with `.peer` set) after an `Error` has been sent back to that peer."""
        timeout = self.recv_timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            frames = self._recv_frames(left)
            peer = bytes(frames[0])
            try:
                if len(frames) < 2:
                    raise ProtocolError("request has no message frames", peer=peer)
                msg = self.codec.decode(frames[1:], peer=peer)
            except ProtocolError as e:
                e.peer = peer
                if self.reply_errors:
                    code = "version" if isinstance(e, ProtocolVersionError) else "protocol"
                    self._try_send(peer, Error(code=code, detail=str(e), protocol=self.codec.protocol))
                raise
            if type(msg) is Hello:
                self._answer_hello(peer, msg)
                continue
            return peer, msg

    def _answer_hello(self, peer: bytes, hello: Hello) -> None:
        if hello.protocol[0] != self.codec.protocol[0]:
            theirs = (hello.protocol[0], hello.protocol[1])
            err = ProtocolVersionError(ours=self.codec.protocol, theirs=theirs, peer=peer)
            self._try_send(peer, Error(code="version", detail=str(err), protocol=self.codec.protocol))
            raise err
        self.peers[peer] = hello
        self._try_send(peer, self.hello)

    def _try_send(self, peer: bytes, msg: Message) -> None:
        try:
            self.send(peer, msg, timeout=0)
        except (PeerUnreachable, ChannelTimeout):
            pass  # the peer left; nothing to tell it

    def send(self, peer: bytes, msg: Message, timeout: float | None = None) -> None:
        try:
            self._send_frames([peer, *self.codec.encode(msg)], timeout)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
        # raised here, outside the handler: a send in a `finally` keeps the exception that led there
        # in its traceback (`raise ... from None` inside the handler would hide that one too)
        raise PeerUnreachable(f"peer {peer!r} is not connected to {self.endpoint}")


class DealerChannel(Channel):
    """Client side of request/reply. `handshake()` exchanges `Hello` with the server."""

    socket_type = zmq.DEALER

    def __init__(self, endpoint: str, **kw: Any) -> None:
        kw.setdefault("bind", False)
        super().__init__(endpoint, **kw)
        self.server: Hello | None = None

    def send(self, msg: Message, timeout: float | None = None) -> None:
        self._send_frames(self.codec.encode(msg), timeout)

    def recv(self, timeout: float | None = None) -> Message:
        return self.codec.decode(self._recv_frames(timeout))

    def request(self, msg: Message, timeout: float | None = None) -> Message:
        """Send `msg` and return the next reply. An `Error` reply is returned, not raised."""
        self.send(msg, timeout)
        return self.recv(timeout)

    def handshake(self, hello: Hello, timeout: float = 10.0) -> Hello:
        """Introduce ourselves; returns the server's Hello. Raises ProtocolVersionError when the
        server speaks another major version, ProtocolError when it refuses us."""
        reply = self.request(hello, timeout)
        if type(reply) is Error:
            if reply.code == "version":
                # a peer older than protocol 1.3 does not say its version: (-1, -1)
                theirs = (reply.protocol[0], reply.protocol[1]) if reply.protocol != (0, 0) else (-1, -1)
                raise ProtocolVersionError(ours=self.codec.protocol, theirs=theirs)
            raise ProtocolError(f"{self.endpoint} refused the handshake: {reply.detail}")
        if type(reply) is not Hello:
            raise ProtocolError(f"{self.endpoint} answered Hello with {type(reply).__name__}")
        self.server = reply
        return reply


def make_hello(role: str, name: str, software: dict[str, str] | None = None) -> Hello:
    """A Hello for this process, with our protocol version, pid and host filled in."""
    return Hello(
        role=role,
        name=name,
        protocol=PROTOCOL_VERSION,
        software=software or {"tidal-core": __version__},
        pid=os.getpid(),
        host=_pysocket.gethostname(),
    )


class Waker:
    """Something `poll` waits on beside channels, set from any thread: a thread that hands a polling loop
    work (a finished generation, applied weights) wakes it at once instead of at its next timeout. A pipe:
    `wake` writes a byte (a full pipe already wakes), `poll` drains it."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        # a wake after close must not write: the descriptor number may already name another file
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._w, b"w")
            except BlockingIOError:  # full: a wake is pending anyway
                pass

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._r)
            os.close(self._w)


def poll(channels: Iterable[Channel], timeout: float | None, waker: Waker | None = None) -> list[Channel]:
    """The channels among `channels` that have a message waiting, after at most `timeout` seconds; returns
    early (possibly with none) when `waker` is woken, and clears it."""
    poller = zmq.Poller()
    by_socket = {}
    for ch in channels:
        ch._check_open()
        poller.register(ch.socket, zmq.POLLIN)
        by_socket[ch.socket] = ch
    if waker is not None:
        poller.register(waker.fileno(), zmq.POLLIN)
    ready = poller.poll(_ms(timeout))
    if waker is not None:
        waker.clear()
    return [by_socket[s] for s, _ in ready if s in by_socket]


# Factories: the default of bind/connect follows how Tidal uses each pattern (the long-lived
# service binds). Every one takes the keyword options of `Channel`.


def push(endpoint: str, *, bind: bool = False, **kw: Any) -> PushChannel:
    return PushChannel(endpoint, bind=bind, **kw)


def pull(endpoint: str, *, bind: bool = True, **kw: Any) -> PullChannel:
    return PullChannel(endpoint, bind=bind, **kw)


def pub(endpoint: str, *, bind: bool = True, **kw: Any) -> PubChannel:
    return PubChannel(endpoint, bind=bind, **kw)


def sub(endpoint: str, *, topics: Iterable[str] = ("",), bind: bool = False, **kw: Any) -> SubChannel:
    return SubChannel(endpoint, topics=topics, bind=bind, **kw)


def router(endpoint: str, *, bind: bool = True, **kw: Any) -> RouterChannel:
    return RouterChannel(endpoint, bind=bind, **kw)


def dealer(endpoint: str, *, bind: bool = False, **kw: Any) -> DealerChannel:
    return DealerChannel(endpoint, bind=bind, **kw)


__all__ = [
    "Channel",
    "DealerChannel",
    "PeerUnreachable",
    "PubChannel",
    "PullChannel",
    "PushChannel",
    "RouterChannel",
    "SubChannel",
    "Waker",
    "dealer",
    "make_hello",
    "max_frame_bytes",
    "poll",
    "pub",
    "pull",
    "push",
    "router",
    "sub",
]
