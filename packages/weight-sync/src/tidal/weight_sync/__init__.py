"""tidal.weight_sync: bucketed, versioned, checksummed weight transfer from a trainer to generators.

Names are imported lazily: loading the plugin module (as every process that scans the `tidal` entry
points does) must not import torch.
"""

from __future__ import annotations

from tidal.core.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "WeightSender": "sender",
    "WeightReceiver": "receiver",
    "load_into": "receiver",
    "WeightSyncError": "errors",
    "WeightFetchCancelled": "errors",
    "WeightSenderGone": "errors",
    "SenderTransport": "transport_base",
    "ReceiverTransport": "transport_base",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
