"""Weight receivers by transport name, from the plugin registry.

Rollout never imports tidal-weight-sync: an announcement (`WeightsAvailable`) names its transport, and
the registry (plugin kind ``weight_transport``) makes a receiver for it. One receiver per transport is
kept, because a receiver holds the previous version (the base of delta updates).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tidal.core.errors import PluginNotFound
from tidal.core.interfaces import NamedTensors, WeightReceiver
from tidal.core.plugins import registry
from tidal.core.protocol import WeightsAvailable


class ReceiverPool:
    def __init__(self, options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.options = {k: dict(v) for k, v in (options or {}).items()}  # transport name -> receiver options
        self._receivers: dict[str, WeightReceiver] = {}

    def get(self, transport: str) -> WeightReceiver:
        if transport not in self._receivers:
            try:
                factory = registry.create("weight_transport", transport)
            except PluginNotFound as e:
                raise PluginNotFound(f"{e}. Weights were announced over {transport!r}: install tidal-weight-sync "
                                     "(or the plugin that provides that transport) next to the engine") from None
            self._receivers[transport] = factory.receiver(self.options.get(transport, {}))
        return self._receivers[transport]

    def receive(self, ann: WeightsAvailable, apply: Callable[[NamedTensors], Any]) -> int:
        return self.get(ann.transport).receive(ann, apply)

    def cancel(self) -> None:
        """Give up the fetch in progress (from another thread), where the receiver can (`cancel()`)."""
        for r in list(self._receivers.values()):
            cancel = getattr(r, "cancel", None)
            if cancel is not None:
                cancel()

    def close(self) -> None:
        for r in self._receivers.values():
            r.close()
        self._receivers.clear()
