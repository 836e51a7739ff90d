"""Loopback endpoints for the sockets of a run, reserved so that nothing else can take them.

The driver picks the endpoints its roles bind (buffer ingest/serve/publish, learner publish, the
controller) before it starts them, so that every role's config can name them. Picking a free port and
releasing it races with every other process that binds a port meanwhile. A `PortReservation` instead
*holds* each port: a socket bound with SO_REUSEADDR and never listening. While it is held the kernel
gives the port to no one else (no ``bind(0)`` hands it out, a plain ``bind`` to it fails), and the one
process meant to serve it can still bind and listen, because ZeroMQ's listeners set SO_REUSEADDR and
Linux lets a listening socket join a bound, non-listening one. A role restarted after a crash binds the
same port again. Release the reservation when the run ends.
"""

from __future__ import annotations

import os
import socket


class PortReservation:
    """Ports held for the lifetime of this object (or until `close`)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._held: list[socket.socket] = []

    def port(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, 0))
        self._held.append(s)
        return s.getsockname()[1]

    def endpoint(self) -> str:
        """``tcp://host:port`` for a ZeroMQ socket to bind (in this process or a child)."""
        return f"tcp://{self.host}:{self.port()}"

    def close(self) -> None:
        for s in self._held:
            s.close()
        self._held.clear()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NODE_ENV = "TIDAL_NODE"  # set by a launcher that places roles on several machines: this machine's name there


def on_this_node(endpoint: str) -> str:
    """`endpoint` with ``{node}`` replaced by this machine's name in the run (`TIDAL_NODE`, which the Ray
    launcher sets to the node's address; "local" without one): a node-local socket path, such as the
    weight relay's, that differs between machines that share a filesystem."""
    return endpoint.replace("{node}", os.environ.get(NODE_ENV, "local"))


__all__ = ["NODE_ENV", "PortReservation", "on_this_node"]
