"""Transports registered by name (plugin kind ``weight_transport``). Each entry is a factory taking the
role ("sender" or "receiver") and options; `WeightSender("zmq")` / `WeightReceiver("zmq")` use them."""

from __future__ import annotations

from typing import Any

from tidal.core.plugins import hookimpl


class _Transport:
    def __init__(self, name: str) -> None:
        self.name = name

    def sender(self, config: dict[str, Any]) -> Any:
        return sender_transport(self.name, **config)

    def receiver(self, config: dict[str, Any]) -> Any:
        return receiver_transport(self.name, **config)


def sender_transport(name: str, **options: Any) -> Any:
    if name == "zmq":
        from tidal.weight_sync.transport_zmq import ZmqSenderTransport

        return ZmqSenderTransport(**options)
    if name == "fs":
        from tidal.weight_sync.transport_fs import FsSenderTransport

        return FsSenderTransport(**options)
    if name == "shm":
        from tidal.weight_sync.transport_shm import ShmSenderTransport

        return ShmSenderTransport(**options)
    if name == "torch_dist":
        from tidal.weight_sync.transport_dist import DistSenderTransport

        return DistSenderTransport(**options)
    raise ValueError(f"unknown weight transport {name!r}; available: zmq, fs, shm, torch_dist")


def receiver_transport(name: str, **options: Any) -> Any:
    if name == "zmq":
        from tidal.weight_sync.transport_zmq import ZmqReceiverTransport

        return ZmqReceiverTransport(**options)
    if name == "fs":
        from tidal.weight_sync.transport_fs import FsReceiverTransport

        return FsReceiverTransport(**options)
    if name == "shm":
        from tidal.weight_sync.transport_shm import ShmReceiverTransport

        return ShmReceiverTransport(**options)
    if name == "torch_dist":
        from tidal.weight_sync.transport_dist import DistReceiverTransport

        return DistReceiverTransport(**options)
    raise ValueError(f"unknown weight transport {name!r}; available: zmq, fs, shm, torch_dist")


@hookimpl
def tidal_weight_transports() -> dict[str, Any]:
    return {name: (lambda n=name: _Transport(n)) for name in ("zmq", "fs", "shm", "torch_dist")}
