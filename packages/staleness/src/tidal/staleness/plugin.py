"""tidal-staleness' built-ins, registered through the `tidal` entry point. No torch at import time:
the buffer loads this to find "version_rejection"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tidal.core.plugins import declare, hookimpl

# name -> "module:class" whose constructor takes the options
_CLASSES = {
    "version_rejection": "rejection:VersionRejection", "depth_gate": "depth:DepthGate",
    "tis": "correction:TokenTIS", "seq_tis": "correction:SequenceTIS", "masked_is": "correction:MaskedIS",
    "off_policy_seq_mask": "correction:OffPolicySequenceMask", "decoupled_ppo": "correction:DecoupledPPO",
}


def _make(name: str) -> Callable[..., Any]:
    def factory(**options: Any) -> Any:
        if name == "version_rejection":
            from tidal.staleness.rejection import VersionRejection

            return VersionRejection(**options)
        if name == "depth_gate":
            from tidal.staleness.depth import DepthGate

            return DepthGate(**options)
        from tidal.staleness.correction import FACTORIES

        return FACTORIES[name][0](**options)

    factory.__name__ = f"make_{name}"
    return declare(factory, signature=f"tidal.staleness.{_CLASSES[name]}")


@hookimpl
def tidal_staleness_policies() -> dict[str, Callable[..., Any]]:
    return {n: _make(n) for n in _CLASSES}
