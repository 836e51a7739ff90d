"""tidal.weight_sync: bucketed, versioned, checksummed weight transfer from a trainer to generators.

Names are imported lazily: loading the plugin module (as every process that scans the `tidal` entry
points does) must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "WeightSender": "sender",
    "WeightReceiver": "receiver",
    "load_into": "receiver",
    "WeightSyncError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.weight_sync' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tidal.weight_sync.{module}"), name)
    globals()[name] = value
    return value
