"""Errors raised by tidal.core. Each one says what was wrong and what to do about it."""

from __future__ import annotations


class TidalError(Exception):
    """Base of every error tidal.core raises on purpose."""


class ProtocolError(TidalError):
    """A message on the wire could not be accepted: malformed, truncated, oversized or wrong-typed.

    `field` names the offending field in dotted form (``Trajectory.completion_ids``) when known.
    `reason` is a short machine-readable kind for per-reason counts (``malformed``, ``invalid``,
    ``too_large``, ``undecodable``, ``wrong_type``, ``not_tidal``, ``version``, ``frames``).
    A receiver raises this for the one bad message and stays usable for the next.
    """

    def __init__(
        self, message: str, *, field: str | None = None, peer: bytes | None = None, reason: str = "invalid"
    ) -> None:
        super().__init__(message)
        self.field = field
        self.peer = peer
        self.reason = reason


class ProtocolVersionError(ProtocolError):
    """The peer speaks another major version of the Tidal wire protocol."""

    def __init__(self, *, ours: tuple[int, int], theirs: tuple[int, int], peer: bytes | None = None) -> None:
        super().__init__(
            f"peer speaks Tidal protocol {theirs[0]}.{theirs[1]}, this process speaks "
            f"{ours[0]}.{ours[1]}; major versions must match. Upgrade tidal-core on the older side "
            f"so both run the same major protocol version.",
            peer=peer,
            reason="version",
        )
        self.ours = ours
        self.theirs = theirs


class ChannelTimeout(TidalError, TimeoutError):
    """Nothing arrived (or could be sent) within the timeout."""


class PeerUnreachable(TidalError):
    """A ROUTER tried to send to a peer that is not (or no longer) connected."""


class ChannelClosed(TidalError):
    """The channel was closed; no further send or receive is possible."""


class SecurityError(TidalError):
    """A channel would carry traffic unauthenticated where that is not allowed, or keys are bad."""


class ConfigError(TidalError):
    """A config file or override is wrong. `field` is the dotted path of the offending field."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PluginNotFound(TidalError, LookupError):
    """No plugin of the asked kind is registered under the asked name."""


class PluginConflict(TidalError):
    """Two plugins registered the same name for the same kind."""


class PluginError(TidalError):
    """A plugin returned something Tidal cannot use (a task whose metadata is not text, ...).
    The message names the plugin, the field and the value, and what the plugin should return."""
