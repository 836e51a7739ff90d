"""The transports that exist, by name, and making one: what `WeightSender("zmq")` / `WeightReceiver("zmq")`
and the plugin registry both read. Transport modules are imported only when one is made, so reading this
list imports no torch."""

from __future__ import annotations

import importlib
from typing import Any

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
