"""Transports registered by name (plugin kind ``weight_transport``). Each entry makes a `WeightSender` or
`WeightReceiver` on its transport (the list is transports.py). Scanning the plugins must not import torch,
so the sender and receiver modules are imported only when one is made."""

from __future__ import annotations

from typing import Any

from tidal.core.plugin_options import NoOptions, signature_options
from tidal.core.plugins import declare, hookimpl
from tidal.weight_sync.transports import TRANSPORTS


class _Transport:
    """What the registry hands out for a transport name: makes a `WeightSender` / `WeightReceiver` on it
    (the `tidal.core.interfaces.WeightTransport` face), so that rollout and the learner get them by name
    without importing this package."""

    def __init__(self, name: str) -> None:
        self.name = name

    def sender(self, config: dict[str, Any]) -> Any:
        # heavy: torch, which scanning the plugins must not load
        from tidal.weight_sync.sender import WeightSender

        return WeightSender(self.name, **config)

    def receiver(self, config: dict[str, Any]) -> Any:
        # heavy: torch, which scanning the plugins must not load
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
