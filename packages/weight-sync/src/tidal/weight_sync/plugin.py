"""Transports registered by name (plugin kind ``weight_transport``). Each entry is a factory taking the
role ("sender" or "receiver") and options; `WeightSender("zmq")` / `WeightReceiver("zmq")` use them.
Transport modules are imported only when used: scanning the plugins must not import torch."""

from __future__ import annotations

import importlib
from typing import Any

from tidal.core.plugin_options import NoOptions, signature_options
from tidal.core.plugins import declare, hookimpl

# name -> (module, sender class, receiver class): the one place that says which transports exist
TRANSPORTS: dict[str, tuple[str, str, str]] = {
    "zmq": ("transport_zmq", "ZmqSenderTransport", "ZmqReceiverTransport"),
    "fs": ("transport_fs", "FsSenderTransport", "FsReceiverTransport"),
    "shm": ("transport_shm", "ShmSenderTransport", "ShmReceiverTransport"),
    "torch_dist": ("transport_dist", "DistSenderTransport", "DistReceiverTransport"),
    "cuda_ipc": ("transport_cuda_ipc", "CudaIpcSenderTransport", "CudaIpcReceiverTransport"),
}


def _make(name: str, role: int, options: dict[str, Any]) -> Any:
    try:
        module, *classes = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown weight transport {name!r}; available: {', '.join(TRANSPORTS)}") from None
    cls = getattr(importlib.import_module(f"tidal.weight_sync.{module}"), classes[role])
    return cls(**options)


def sender_transport(name: str, **options: Any) -> Any:
    return _make(name, 0, options)


def receiver_transport(name: str, **options: Any) -> Any:
    return _make(name, 1, options)


class _Transport:
    """What the registry hands out for a transport name: makes a `WeightSender` / `WeightReceiver` on it
    (the `tidal.core.interfaces.WeightTransport` face), so that rollout and the learner get them by name
    without importing this package."""

    def __init__(self, name: str) -> None:
        self.name = name

    def sender(self, config: dict[str, Any]) -> Any:
        from tidal.weight_sync.sender import WeightSender

        return WeightSender(self.name, **config)

    def receiver(self, config: dict[str, Any]) -> Any:
        from tidal.weight_sync.receiver import WeightReceiver

        return WeightReceiver(self.name, **config)

    def sender_options(self) -> type:
        """The options `sender(config)` takes: `WeightSender`'s and its transport's (a msgspec Struct)."""
        module, sender, _ = TRANSPORTS[self.name]
        return signature_options(f"{self.name}_sender_options", "tidal.weight_sync.sender:WeightSender",
                                 f"tidal.weight_sync.{module}:{sender}", skip=("transport",))

    def receiver_options(self) -> type:
        """The options `receiver(config)` takes: `WeightReceiver`'s and its transport's."""
        module, _, receiver = TRANSPORTS[self.name]
        return signature_options(f"{self.name}_receiver_options", "tidal.weight_sync.receiver:WeightReceiver",
                                 f"tidal.weight_sync.{module}:{receiver}", skip=("transport",))


@hookimpl
def tidal_weight_transports() -> dict[str, Any]:
    # the factory takes no options; a transport's options are its sender's and receiver's (above)
    return {name: declare(lambda n=name: _Transport(n), options=NoOptions) for name in TRANSPORTS}
