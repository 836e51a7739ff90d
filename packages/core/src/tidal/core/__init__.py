"""tidal.core: the wire protocol, channels, plugin registry and config loading every Tidal package shares.

Light on purpose: msgspec, pyzmq, pluggy and numpy; never torch.
"""

from tidal.core.arrays import Array
from tidal.core.codec import Codec
from tidal.core.errors import (
    ChannelClosed,
    ChannelTimeout,
    ConfigError,
    PluginConflict,
    PluginNotFound,
    ProtocolError,
    ProtocolVersionError,
    SecurityError,
    TidalError,
)
from tidal.core.protocol import PROTOCOL_VERSION

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "Array",
    "ChannelClosed",
    "ChannelTimeout",
    "Codec",
    "ConfigError",
    "PluginConflict",
    "PluginNotFound",
    "ProtocolError",
    "ProtocolVersionError",
    "SecurityError",
    "TidalError",
    "__version__",
]
