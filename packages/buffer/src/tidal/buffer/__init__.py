"""tidal.buffer: the joint between generation and training. No torch.

Run the service with ``tidal-buffer`` (or ``python -m tidal.buffer``); learners use `BatchClient`;
rollout workers push with `tidal.core.reliable.AckedPusher`.
"""

from tidal.buffer.client import BatchClient
from tidal.buffer.config import BufferConfig, PluginRef

__version__ = "0.1.0"

__all__ = ["BatchClient", "BufferConfig", "PluginRef", "__version__"]
